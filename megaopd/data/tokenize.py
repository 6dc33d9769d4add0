"""Token ids of prompts and golden solutions, and the loss mask of mixture distillation.

    ex = build_examples(records, "opd", cfg, tok)[0][0]
    ex.prompt_ids                  what the engines generate after
    ex.golden_ids, ex.golden_loss_mask   prompt + solution + end-of-turn; mask 1 exactly on the solution
                                         tokens and the end-of-turn token, 0 on the prompt
    ex.teacher_prompt_ids          data.teacher_prompt=own: what the teacher scores the response after
    batch = golden_batch(examples, pad_id)   right-padded tensors for the SFT term of the loss

The solution is tokenized on its own and appended to the prompt ids instead of tokenizing prompt+solution
as one text: the student's rollouts are generated token by token after exactly `prompt_ids`, so the golden
must share that boundary (BPE merges across it would give the SFT term a prompt the student never sees).
The golden ends with the token that ends an assistant turn in the chat template (<|im_end|> for Qwen), read
from the template itself, so the student learns to stop where its rollouts must stop.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np
import torch

from megaopd.data.config import DataConfig
from megaopd.data.openr1 import GoldenRecord
from megaopd.data.special_tokens import stop_tokens, turn_end_token  # noqa: F401 (turn_end_token: re-export)
from megaopd.data.templates import _template_tokenizer, render_prompt, strip_think_overlap


@dataclass
class PromptExample:
    """One prompt of the stream, tokenized, with its golden solution (when it has one)."""

    uid: str
    source: str
    """Name of the DataConfig source it came from."""
    problem: str
    answer: str
    prompt_text: str
    prompt_ids: list[int]
    teacher_prompt_ids: Optional[list[int]] = None
    """With data.teacher_prompt=own: the problem rendered by the teacher's chat template, in the teacher
    tokenizer's ids; the teacher scores the response after these instead of prompt_ids. None: shared."""
    golden: Optional[str] = None
    """The golden solution text as tokenized (after strip_think_overlap), without the end-of-turn token."""
    solution_ids: Optional[np.ndarray] = None
    """int32 [S]: the golden response ids, end-of-turn token last (unless truncated). Kept as a compact
    array: 13k goldens of up to 8k tokens as Python ints would take gigabytes."""
    teacher: str = ""
    """Name of the teacher that scores its responses (its source's `teacher`); empty: the job's one teacher."""
    solution_mask: Optional[np.ndarray] = None
    """int8 [S] beside solution_ids for a multi-turn golden (tool calls with their results): 1 on the
    assistant's tokens, 0 on the environment's tool turns (never trained, as in on-policy trajectories);
    None: every solution token is the assistant's."""

    @property
    def has_golden(self) -> bool:
        return self.solution_ids is not None

    @property
    def golden_ids(self) -> list[int]:
        """prompt_ids + solution ids: the sequence the SFT term is computed on."""
        if self.solution_ids is None:
            raise ValueError(f"prompt {self.uid} of source {self.source!r} has no golden solution")
        return self.prompt_ids + self.solution_ids.tolist()

    @property
    def golden_loss_mask(self) -> list[int]:
        """1 on each solution token (a target of the SFT term), 0 on the prompt; aligned with golden_ids."""
        if self.solution_ids is None:
            raise ValueError(f"prompt {self.uid} of source {self.source!r} has no golden solution")
        solution = [1] * len(self.solution_ids) if self.solution_mask is None else self.solution_mask.tolist()
        return [0] * len(self.prompt_ids) + solution


def golden_stop_id(cfg: DataConfig, tokenizer, teacher_tokenizer=None) -> int:
    """Id of the token appended to every golden solution: the first of the rollouts' stop ids (the
    template's turn end; see data.special_tokens), so the student learns to stop where rollouts stop."""
    return stop_tokens(cfg, tokenizer, teacher_tokenizer).golden_id


def build_examples(
    records: Sequence[GoldenRecord],
    source: str,
    cfg: DataConfig,
    tokenizer,
    teacher_tokenizer=None,
    stop_id: Optional[int] = None,
    tools: Optional[list] = None,
) -> tuple[list[PromptExample], Counter, dict]:
    """Renders and tokenizes records; returns (examples, skipped reasons, reason -> first uuid).

    A prompt over max_prompt_len is skipped; so is a golden over max_golden_len (golden_overflow=skip) or
    it is cut (truncate). Records without a golden give examples without one unless cfg.require_golden.
    stop_id: the golden's last token (default: golden_stop_id, the rollouts' first stop id).
    tools: a multi-turn environment's tool schemas, rendered into the prompts by the chat template.
    """
    template_tok = _template_tokenizer(cfg, tokenizer, teacher_tokenizer)
    if stop_id is None and any(r.golden for r in records):
        stop_id = golden_stop_id(cfg, tokenizer, teacher_tokenizer)
    texts = [render_prompt(r.problem, cfg, tokenizer, teacher_tokenizer, tools) for r in records]
    # One batched call each (fast tokenizers parallelize it); no special tokens, see encode_prompt.
    prompt_ids = template_tok(texts, add_special_tokens=False)["input_ids"] if texts else []
    goldens = [strip_think_overlap(t, r.golden) if r.golden else None for t, r in zip(texts, records)]
    with_golden = [i for i, g in enumerate(goldens) if g is not None]
    sol_ids = dict(
        zip(
            with_golden,
            tokenizer([goldens[i] for i in with_golden], add_special_tokens=False)["input_ids"] if with_golden else [],
        )
    )

    teacher_ids = _teacher_prompt_ids(records, cfg, tokenizer, teacher_tokenizer)
    sol_masks = _multi_turn_goldens(goldens, sol_ids, tokenizer)

    examples, skipped, first = [], Counter(), {}

    def skip(reason, rec):
        skipped[reason] += 1
        first.setdefault(reason, rec.uuid)

    for i, rec in enumerate(records):
        ids = list(prompt_ids[i])
        if len(ids) > cfg.max_prompt_len or (teacher_ids and len(teacher_ids[i]) > cfg.max_prompt_len):
            skip(f"prompt over max_prompt_len={cfg.max_prompt_len} tokens", rec)
            continue
        solution, mask = None, None
        if i in sol_ids:
            sol = list(sol_ids[i]) + [stop_id]
            mask = sol_masks[i] + [1] if i in sol_masks else None
            if len(sol) > cfg.max_golden_len:
                if cfg.golden_overflow == "skip":
                    skip(f"golden over max_golden_len={cfg.max_golden_len} tokens", rec)
                    continue
                sol = sol[: cfg.max_golden_len]
                mask = mask[: cfg.max_golden_len] if mask is not None else None
            solution = np.asarray(sol, dtype=np.int32)
        elif cfg.require_golden:
            skip("no golden solution", rec)
            continue
        examples.append(
            PromptExample(
                uid=rec.uuid,
                source=source,
                problem=rec.problem,
                answer=rec.answer,
                prompt_text=texts[i],
                prompt_ids=ids,
                golden=goldens[i],
                solution_ids=solution,
                solution_mask=None if mask is None or solution is None else np.asarray(mask, dtype=np.int8),
                teacher_prompt_ids=list(teacher_ids[i]) if teacher_ids else None,
            )
        )
    return examples, skipped, first


def _multi_turn_goldens(goldens: list, sol_ids: dict, tokenizer) -> dict[int, list[int]]:
    """Multi-turn goldens (a turn end inside the text, then a tool turn and the next assistant header):
    re-tokenized turn by turn, as a trajectory is built (the assistant's ids, then the tool turn's ids on
    their own), into sol_ids; returns their masks (1 the assistant's tokens, 0 the tool turns')."""
    if not getattr(tokenizer, "chat_template", None):
        return {}
    turn_end = turn_end_token(tokenizer)
    user = [{"role": "user", "content": "x"}]
    header = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)[
        len(tokenizer.apply_chat_template(user, tokenize=False)) :
    ]
    masks = {}
    for i, g in enumerate(goldens):
        if g is None or not header or turn_end not in g.rstrip()[: -len(turn_end)]:
            continue
        ids, mask, rest = [], [], g
        while True:
            at = rest.find(turn_end)
            nxt = rest.find(header, at + len(turn_end)) if at >= 0 else -1
            if nxt < 0:
                pieces = [(rest, 1)]
            else:
                cut = at + len(turn_end)
                pieces = [(rest[:cut], 1), (rest[cut : nxt + len(header)], 0)]
            for text, m in pieces:
                part = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
                ids += part
                mask += [m] * len(part)
            if nxt < 0:
                break
            rest = rest[nxt + len(header) :]
        if 0 in mask:
            sol_ids[i], masks[i] = ids, mask
    return masks


def _teacher_prompt_ids(records: Sequence[GoldenRecord], cfg: DataConfig, tokenizer, teacher_tokenizer):
    """The teacher's own prompts (data.teacher_prompt=own), or None (shared: the student's prompt ids)."""
    if cfg.teacher_prompt != "own":
        return None
    if teacher_tokenizer is None:
        raise ValueError(
            "data.teacher_prompt=own needs the teacher's tokenizer: pass teacher_tokenizer (the "
            "teacher model directory's tokenizer), or set data.teacher_prompt=shared"
        )
    own = replace(cfg, prompt_template="teacher")
    texts = [render_prompt(r.problem, own, tokenizer, teacher_tokenizer) for r in records]
    return teacher_tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


@dataclass
class GoldenBatch:
    """Right-padded golden sequences of a batch (the SFT term's input).

    input_ids_BT   int64 [B, T]  prompt + solution ids, then pad_id
    loss_mask_BT   float32 [B, T] 1 where the token is a solution token, i.e. a target predicted from the
                   positions before it (the loss shifts: logits at t-1 score input_ids_BT[:, t])
    attention_mask_BT int64 [B, T] 1 on real tokens
    lengths_B      int64 [B] real length of each row
    """

    input_ids_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    lengths_B: torch.Tensor


def golden_batch(examples: Sequence[PromptExample], pad_id: int) -> GoldenBatch:
    rows = [ex.golden_ids for ex in examples]
    masks = [ex.golden_loss_mask for ex in examples]
    T = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), T), int(pad_id), dtype=torch.long)
    loss = torch.zeros((len(rows), T), dtype=torch.float32)
    attn = torch.zeros((len(rows), T), dtype=torch.long)
    for b, (r, m) in enumerate(zip(rows, masks)):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        loss[b, : len(m)] = torch.tensor(m, dtype=torch.float32)
        attn[b, : len(r)] = 1
    return GoldenBatch(ids, loss, attn, torch.tensor([len(r) for r in rows], dtype=torch.long))
