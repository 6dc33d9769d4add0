"""Can the teacher score the student's token ids? Same regular vocabulary required, special names may differ.

    report = compare_vocab(student_tok, teacher_tok, student_path, teacher_path, stop_ids=stop.ids)
    for line in report.log_lines(): log(line)
    masked_ids = resolve_token_names(student_tok, cfg.loss.mask_first_tokens) + list(report.mask_ids)

OPD scores the student's sampled ids with the teacher, so every id the student emits must mean the same
text to both. What must match is the REGULAR vocabulary (the BPE pieces): same token -> id map, and the
same ids for the same text (probe texts encoded by both, which also catches a different normalizer,
pre-tokenizer or merge list). A different regular vocabulary is refused with an error naming tokens.

Added (special) tokens may differ in name, and in the paper's own pairs they do (public copies of the
released tokenizer files; the Hub itself is not reachable from here):
  - Qwen2.5 tokenizers (base, Math, Instruct): 151643 <|endoftext|>, 151644 <|im_start|>, 151645
    <|im_end|>, then <|object_ref_start|> ... (Qwen2.5-*-Instruct tokenizer_config.json, e.g. the copy
    quoted on https://hf-mirror.492719920.workers.dev./tugstugi/Qwen2.5-7B-Instruct-QwQ-v0.1 ...
    /tokenizer_config.json). A base model's EOS is 151643 <|endoftext|> (config.json eos_token_id 151643;
    QwenLM/Qwen3 issue #927, "The eos_token of the Qwen 2.5 base model"); an Instruct tokenizer's EOS is
    <|im_end|>. Qwen2.5-Math-7B's own tokenizer_config.json was not found in a public copy here; as a base
    model its EOS is <|endoftext|>.
  - OpenThinker3-7B is a supervised fine-tune of Qwen2.5-7B-Instruct (OpenThoughts, arXiv 2506.04178),
    so it carries the Instruct tokenizer: same names at 151643-151645, EOS <|im_end|>. Against a
    Qwen2.5-Math base student nothing is renamed; only the EOS differs (both ids are rollout stops).
  - DeepSeek-R1-Distill-Qwen tokenizer_config.json (a verbatim copy of the 1.5B one, the family shares
    it, found through the code search): 151643 <｜end▁of▁sentence｜> (eos and pad), 151644 <｜User｜>,
    151645 <｜Assistant｜>, 151646 <｜begin▁of▁sentence｜> (bos), 151647 <|EOT|>, 151648 <think>,
    151649 </think>, then the Qwen names again from 151650 <|quad_start|> to 151664 <|file_sep|>.
    IyngkarranKumar/test_time_emergent_scaling utils/tokenization_setup.py agrees: R1-distill's
    generation prompt '<｜Assistant｜><think>\\n' is [151645, 151648, 198].
So with a Qwen2.5-Math student and an R1-distill teacher the student's turn end <|im_end|> (151645) reads
as <｜Assistant｜> to the teacher, which scores it as very unlikely: the huge negative reward teaches the
student not to stop. Such ids are masked from the loss (special-token masking, LSM paper 2603.25562):
`mask_ids` lists every id the student can emit that the teacher names differently (or lacks), except
ids that end the response for both (151643: the student's EOS, the teacher's EOS) whose teacher score is
the meaningful "stop here". The masking is the loss's first-occurrence masking (losses.masking): a stop
token is the last token of a response, so its first occurrence is its only one.
Pure functions of two tokenizer objects; nothing is read from disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from megaopd.data.special_tokens import turn_end_token

DEFAULT_PROBES = (
    "Solve for x: 3x + 5 = 20. Subtract 5 from both sides, so 3x = 15 and x = 5.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "\\frac{a}{b} + \\sqrt{2}^{3} - \\left( x_1 \\cdot y_{12} \\right) = \\boxed{-\\tfrac{7}{8}}",
    "  two leading spaces\n\n\ttab, trailing spaces  \r\nCRLF line\n",
    "1234567890 0.5 1e-6 3,141,592 (1, 2) [3; 4] {5: 6}",
    "Ünïcödé façade — naïve 数学题 ∑_{k=1}^{n} k = n(n+1)/2, π ≈ 3.14159 ✓",
    "Wait, let me double-check... Hmm. OK: the answer is 42!",
)
"""Texts both tokenizers must encode to the same ids (no special tokens added). They avoid added-token
strings such as <think>: those are added tokens in some tokenizers of a family and plain text in others."""


class VocabMismatchError(ValueError):
    """The teacher's regular vocabulary maps text to other ids than the student's."""


@dataclass(frozen=True)
class SpecialIdDiff:
    """One added-token id that the two tokenizers name differently (None: that side has no token there)."""

    id: int
    student: Optional[str]
    teacher: Optional[str]
    masked: bool
    """True when the id goes into the loss's masked ids (the student can emit it, the teacher reads it as
    something else)."""
    why: str

    def log_line(self) -> str:
        s = self.student if self.student is not None else "(none)"
        t = self.teacher if self.teacher is not None else "(none)"
        action = "masked in the loss" if self.masked else "kept"
        return f"[vocab] id {self.id}: student {s}, teacher {t}: {action} ({self.why})"


@dataclass(frozen=True)
class VocabReport:
    """What compare_vocab found: the pair is usable; these special ids differ."""

    regular_size: int
    """Size of the shared regular vocabulary (added tokens excluded)."""
    probes: int
    """Number of probe texts both tokenizers encoded to the same ids."""
    student_eos: tuple[str, int]
    teacher_eos: tuple[Optional[str], Optional[int]]
    diffs: tuple[SpecialIdDiff, ...]
    """Every added-token id named differently, ascending."""

    @property
    def mask_ids(self) -> tuple[int, ...]:
        """Ids to add to the loss's masked ids (first occurrence per response masked)."""
        return tuple(d.id for d in self.diffs if d.masked)

    @property
    def renamed_ids(self) -> tuple[int, ...]:
        """Ids both tokenizers have, under different names."""
        return tuple(d.id for d in self.diffs if d.student is not None and d.teacher is not None)

    def log_lines(self) -> list[str]:
        lines = [
            f"[vocab] teacher shares the student's regular vocabulary ({self.regular_size} tokens; "
            f"{self.probes} probe texts encode to the same ids)"
        ]
        (se, sid), (te, tid) = self.student_eos, self.teacher_eos
        if (se, sid) != (te, tid):
            lines.append(
                f"[vocab] EOS differs: student {se}={sid}, teacher {te}={tid} (accepted: rollouts stop "
                f"at the template's turn end and the student's EOS)"
            )
        lines += [d.log_line() for d in self.diffs]
        if self.mask_ids:
            lines.append(
                f"[vocab] {len(self.mask_ids)} special ids the teacher names differently are added to "
                f"the loss's masked ids: {list(self.mask_ids)}"
            )
        return lines


def _added(tok) -> dict[int, str]:
    return {int(i): str(getattr(t, "content", t)) for i, t in (tok.added_tokens_decoder or {}).items()}


def _regular(tok, added_ids: set[int]) -> dict[str, int]:
    return {k: int(v) for k, v in tok.get_vocab().items() if int(v) not in added_ids}


def _end_ids(tok) -> set[int]:
    """EOS and the chat template's turn end: the ids after which this tokenizer's model has finished."""
    ids = set()
    for name in (tok.eos_token, turn_end_token(tok)):
        tid = tok.convert_tokens_to_ids(name) if name is not None else None
        if tid is not None:
            ids.add(int(tid))
    return ids


def _fmt(tokens: Iterable) -> str:
    return "[" + ", ".join(repr(t) for t in tokens) + "]"


def _regular_mismatch(sv: dict[str, int], tv: dict[str, int]) -> list[str]:
    problems = []
    only_s = sorted(set(sv) - set(tv))
    only_t = sorted(set(tv) - set(sv))
    moved = sorted(k for k in set(sv) & set(tv) if sv[k] != tv[k])
    if only_s:
        problems.append(f"{len(only_s)} tokens only in the student's, e.g. {_fmt(only_s[:5])}")
    if only_t:
        problems.append(f"{len(only_t)} tokens only in the teacher's, e.g. {_fmt(only_t[:5])}")
    if moved:
        problems.append(
            f"{len(moved)} tokens with other ids, e.g. "
            + ", ".join(f"{k!r} student {sv[k]} / teacher {tv[k]}" for k in moved[:5])
        )
    return problems


def compare_vocab(
    student,
    teacher,
    student_path: str = "student",
    teacher_path: str = "teacher",
    stop_ids: Sequence[int] = (),
    probes: Sequence[str] = DEFAULT_PROBES,
) -> VocabReport:
    """Checks that `teacher` reads the student's ids as the same text; returns a VocabReport, or raises
    VocabMismatchError naming tokens when the regular vocabularies differ.

    stop_ids: the rollouts' stop ids (data.special_tokens.stop_tokens(...).ids): ids the student ends
    with besides its own EOS and turn end (e.g. the teacher template's turn end)."""
    s_added, t_added = _added(student), _added(teacher)
    sv = _regular(student, set(s_added))
    tv = _regular(teacher, set(t_added))
    problems = _regular_mismatch(sv, tv)
    for text in probes:
        s_ids = list(student(text, add_special_tokens=False)["input_ids"])
        t_ids = list(teacher(text, add_special_tokens=False)["input_ids"])
        if s_ids != t_ids:
            problems.append(
                f"{text!r} encodes to student {_fmt(student.convert_ids_to_tokens(s_ids)[:12])} "
                f"but teacher {_fmt(teacher.convert_ids_to_tokens(t_ids)[:12])}"
            )
            break
    if problems:
        raise VocabMismatchError(
            f"teacher tokenizer ({teacher_path}) does not match the student's ({student_path}): its regular "
            f"vocabulary maps text to other ids: {'; '.join(problems)}. OPD scores the student's token ids with "
            f"the teacher, so both need one regular vocabulary (special tokens may differ in name): pick a "
            f"teacher of the student's family (e.g. a Qwen2.5 derivative for a Qwen2.5-Math student)"
        )

    s_end = _end_ids(student) | {int(i) for i in stop_ids}
    t_end = _end_ids(teacher)
    diffs = []
    for tid in sorted(set(s_added) | set(t_added)):
        s_name, t_name = s_added.get(tid), t_added.get(tid)
        if s_name == t_name:
            continue
        if s_name is None:
            diffs.append(SpecialIdDiff(tid, None, t_name, False, "teacher only: the student cannot emit it"))
        elif tid in s_end and tid in t_end:
            diffs.append(
                SpecialIdDiff(
                    tid, s_name, t_name, False, "ends the response for both: the teacher's score of it is meaningful"
                )
            )
        elif t_name is None:
            diffs.append(SpecialIdDiff(tid, s_name, None, True, "the teacher has no token at this id"))
        else:
            role = "the student's stop token" if tid in s_end else "the student can emit it"
            diffs.append(SpecialIdDiff(tid, s_name, t_name, True, f"{role}; the teacher reads another token"))
    t_eos_id = teacher.eos_token_id
    return VocabReport(
        regular_size=len(sv),
        probes=len(probes),
        student_eos=(str(student.eos_token), int(student.eos_token_id)),
        teacher_eos=(teacher.eos_token, None if t_eos_id is None else int(t_eos_id)),
        diffs=tuple(diffs),
    )


def resolve_token_names(tokenizer, names: Sequence[str]) -> list[int]:
    """Ids of token names (e.g. loss.mask_first_tokens) in `tokenizer`; a name it does not have is an error
    (convert_tokens_to_ids would silently give the unknown token's id, or None)."""
    ids = []
    vocab = tokenizer.get_vocab()
    for name in names:
        if name not in vocab:
            raise ValueError(
                f"loss.mask_first_tokens names {name!r}, which the student tokenizer "
                f"({getattr(tokenizer, 'name_or_path', '?')}) does not have as one token: use a "
                f"token of its vocabulary (e.g. its EOS {tokenizer.eos_token!r})"
            )
        ids.append(int(vocab[name]))
    return ids


def loss_mask_ids(tokenizer, names: Sequence[str], report: Optional[VocabReport]) -> list[int]:
    """The loss's masked ids: the configured names (resolved in the student's tokenizer) plus the report's
    renamed special ids, de-duplicated, order kept."""
    ids = resolve_token_names(tokenizer, names) + (list(report.mask_ids) if report is not None else [])
    return list(dict.fromkeys(ids))


__all__ = [
    "DEFAULT_PROBES",
    "SpecialIdDiff",
    "VocabMismatchError",
    "VocabReport",
    "compare_vocab",
    "loss_mask_ids",
    "resolve_token_names",
]
