"""A row's teacher view: the token sequence a teacher scores for one student response, and the map back.

    prompt = TeacherPrompt(context="{golden}\\n\\n{problem}", data=cfg.data, tokenizer=tok)   # teacher.context
    prefix = prompt.prefix_ids(example)            # the teacher's own prompt of the row, in its ids
    view = teacher_view(prefix, response_ids)      # TeacherView: ids, response_start, the map back

By default a teacher scores exactly the student's tokens: the student's prompt, then its response. A teacher
with a view of its own (`teacher.context`, `teacher.tokenizer: own`, or data.teacher_prompt=own) reads the
response after a prefix of its own instead: the row's fields put into `teacher.context` (the golden solution in
front of the problem: privileged-context self-distillation, OPSD / SDFT), rendered by its chat template. Under
the student's tokenizer the response tokens are the student's, one for one: only the prefix differs, and the
teacher's log-prob at view position `response_start - 1 + j` is its log q of the student's response token j.
A teacher of another vocabulary (`teacher.tokenizer: own`, and the start-up check found other ids) reads the
response's text re-tokenized by its own tokenizer (megaopd.data.alignment.align_response): the view then
carries the SpanAlignment of the two tokenizations, over which its scores are mapped back.

The fields a context may name (str.replace, as data.user_format: problems are LaTeX and full of braces):
  {problem}      the row's problem text
  {golden}       its golden solution (the text the SFT term trains on, without the end-of-turn token)
  {answer}       its final answer
  {instruction}  data.instruction
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from megaopd.data.alignment import align_response
from megaopd.data.config import DataConfig
from megaopd.data.templates import render_user, user_message

CONTEXT_FIELDS = ("problem", "golden", "answer", "instruction")
TEACHER_TOKENIZERS = ("student", "own")


def context_fields(context: str) -> list[str]:
    """The {field} names a context template uses, in order of first use."""
    seen: list[str] = []
    for name in re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", context):
        if name not in seen:
            seen.append(name)
    return seen


def check_context_fields(key: str, context: str) -> None:
    """Refuses a context template that names a field a data row does not have (one line, with the choices)."""
    unknown = [f for f in context_fields(context) if f not in CONTEXT_FIELDS]
    if unknown:
        raise ValueError(
            f"{key}.context names {', '.join('{' + f + '}' for f in unknown)}, which a data row does not have: "
            f"use {', '.join('{' + f + '}' for f in CONTEXT_FIELDS)}"
        )


def render_context(context: str, example: Any, data: DataConfig) -> str:
    """The teacher's user message of one data row (a PromptExample): the context with its fields filled."""
    values = {"problem": example.problem, "golden": example.golden, "answer": example.answer}
    values["instruction"] = data.instruction
    out = context
    for name in context_fields(context):
        if values.get(name) is None:
            raise ValueError(
                f"teacher.context uses {{{name}}} but prompt {example.uid} of source {example.source!r} has no "
                f"{name}: keep data.require_golden=true (rows without a golden solution are then skipped)"
            )
        out = out.replace("{" + name + "}", values[name])
    return out


@dataclass(frozen=True, kw_only=True)
class TeacherPrompt:
    """How one teacher's prefix of a row is made: its context template, the data section's chat settings
    (system prompt, plain or templated) and the tokenizer whose chat template and ids the teacher reads."""

    context: str = ""
    """teacher.context; empty: the student's user message (data.user_format)."""
    data: DataConfig
    tokenizer: Any
    """The student's tokenizer (teacher.tokenizer: student) or the teacher's own (own)."""
    own: bool = False
    """teacher.tokenizer=own: without a context the problem is rendered by the teacher's chat template (with
    one, it always is: `tokenizer`'s)."""
    tools: Any = None
    """A multi-turn environment's tool schemas, rendered by the chat template as in the student's prompt (the
    trajectory's tool turns after it are the student's tokens, which only a same-tokenizer teacher reads)."""
    student_tokenizer: Any = None
    """Set when the teacher's vocabulary is not the student's (cross-tokenizer): the student's tokenizer, whose
    response ids are decoded to the text the teacher re-tokenizes. None: the response ids are the teacher's."""

    @property
    def cross(self) -> bool:
        return self.student_tokenizer is not None

    def view(self, prefix_ids: Sequence[int], response_ids: Sequence[int]) -> "TeacherView":
        """The row's TeacherView: its prefix, then the response in the teacher's tokens."""
        if not self.cross:
            return teacher_view(prefix_ids, response_ids)
        return cross_teacher_view(prefix_ids, response_ids, self.student_tokenizer, self.tokenizer)

    def prefix_ids(self, example: Any) -> list[int]:
        """The teacher's ids before the response for one data row (a PromptExample)."""
        if self.context:
            user = render_context(self.context, example, self.data)
        elif self.own:
            user = user_message(example.problem, self.data)
        else:  # the student's prompt ids, or data.teacher_prompt=own's (the problem in the teacher's template)
            return list(example.teacher_prompt_ids or example.prompt_ids)
        text = render_user(user, self.data, self.tokenizer, self.tools)
        # No special tokens added: the chat template writes its own (as data.templates.encode_prompt).
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True, kw_only=True)
class TeacherView:
    """One row's sequence as its teacher scores it."""

    ids: list[int]
    """The teacher's token ids: its own prefix, then the student's response in the teacher's tokens."""
    response_start: int
    """Index in `ids` of the response's first token (the prefix's length)."""
    alignment: Any = None
    """The map back to the student's response tokens: None = the response tokens are the student's, one for
    one (same tokenizer); a cross-tokenizer teacher's SpanAlignment (megaopd.data.alignment) otherwise."""

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.response_start


def teacher_view(prefix_ids: Sequence[int], response_ids: Sequence[int]) -> TeacherView:
    """A same-tokenizer teacher's view: its prefix, then the student's response tokens unchanged."""
    return TeacherView(ids=list(prefix_ids) + list(response_ids), response_start=len(prefix_ids))


def cross_teacher_view(
    prefix_ids: Sequence[int], response_ids: Sequence[int], student_tokenizer, teacher_tokenizer
) -> TeacherView:
    """A teacher of another vocabulary: its prefix, then the response's text (the student's regular tokens
    decoded; special tokens and chat markup dropped) in its own tokens, aligned with the student's by
    characters (megaopd.data.alignment)."""
    _text, teacher_ids, alignment = align_response(student_tokenizer, teacher_tokenizer, list(response_ids))
    return TeacherView(ids=list(prefix_ids) + list(teacher_ids), response_start=len(prefix_ids), alignment=alignment)


__all__ = [
    "CONTEXT_FIELDS",
    "TEACHER_TOKENIZERS",
    "TeacherPrompt",
    "TeacherView",
    "check_context_fields",
    "cross_teacher_view",
    "context_fields",
    "render_context",
    "teacher_view",
]
