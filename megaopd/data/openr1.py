"""The OpenR1-Math-220k schema, the paper's golden-solution filter, and the deterministic SFT/OPD split.

Raw schema (huggingface.co/datasets/open-r1/OpenR1-Math-220k, config "default", 93,733 rows); the columns
megaopd reads, the others are ignored:
    problem (str), answer (str), uuid (str), source (str),
    generations (list[str])             DeepSeek-R1 traces "<think>\\n...\\n</think>\\n\\n... \\boxed{...}"
    correctness_math_verify (list[bool]) math-verify's judgement of each generation against `answer`
    is_reasoning_complete (list[bool])   whether each trace reached its end
    (solution = NuminaMath's reference solution, finish_reasons, correctness_llama, correctness_count,
     messages: not used)

Filter (paper 2604.08527 sec. 5.1 after Yan et al. 2025): a generation is usable when math-verify judged it
correct, it is at most 8192 tokens, and (ours) its reasoning is complete; a prompt is kept when one of its
generations is usable, and that one becomes its golden solution (94k prompts -> ~46k in the paper). The
prompts are then shuffled with a seed and cut into 33k for the cold-start SFT and 13k for OPD.

Prepared format, one row per prompt (written by tools/prepare_openr1_math.py, read by megaopd.data):
    uuid (str), problem (str), answer (str), source (str),
    golden (str | null)         the chosen verified generation, verbatim (including its <think> block)
    golden_tokens (int | null)  its length in tokens of the tokenizer the filter counted with
Rows of either format, and prompt-only rows (problem + answer), are accepted wherever data is loaded.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from megaopd.data.config import FilterConfig

TokenCounter = Callable[[Sequence[str]], Sequence[int]]
"""Lengths in tokens of a batch of texts (see `token_counter`)."""


class DataError(ValueError):
    """Data that cannot be used; the message names the file(s) and the fix."""


@dataclass
class GoldenRecord:
    """One prompt with its answer and (optionally) its golden solution, in the prepared format."""

    uuid: str
    problem: str
    answer: str
    source: str = ""
    golden: Optional[str] = None
    golden_tokens: Optional[int] = None

    def to_row(self) -> dict:
        return {
            "uuid": self.uuid,
            "problem": self.problem,
            "answer": self.answer,
            "source": self.source,
            "golden": self.golden,
            "golden_tokens": self.golden_tokens,
        }


@dataclass
class LoadReport:
    """What happened to every row of a source: kept, or skipped for a named reason (with where it first
    happened), plus the fate of each generation when golden solutions were chosen on load."""

    name: str
    files: list[str] = field(default_factory=list)
    rows: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    first_skipped: dict = field(default_factory=dict)
    """reason -> location ("file:row") of the first row skipped for it."""
    generations: Counter = field(default_factory=Counter)

    def skip(self, loc: str, reason: str) -> None:
        self.skipped[reason] += 1
        self.first_skipped.setdefault(reason, loc)

    def summary(self) -> str:
        parts = [f"{self.name}: {self.kept}/{self.rows} rows kept"]
        if self.skipped:
            parts.append(
                "skipped: "
                + ", ".join(f"{r} x{n} (first at {self.first_skipped[r]})" for r, n in self.skipped.most_common())
            )
        if self.generations:
            parts.append("generations: " + ", ".join(f"{k} {v}" for k, v in sorted(self.generations.items())))
        return "; ".join(parts)

    def raise_if_empty(self, fix: str) -> None:
        if self.kept == 0:
            files = ", ".join(self.files) or "(no files)"
            raise DataError(f"no usable rows in {files}: {self.summary()}. Fix: {fix}")


def answer_matches(answer: str, text: str) -> bool:
    """math-verify's judgement of `text` (its last \\boxed{} or final expression) against `answer`."""
    from math_verify import parse, verify  # imported here: sympy's import costs a second

    try:
        # The gold is boxed so that bare LaTeX answers ("\\frac{1}{2}", "\\text{(B)}") parse as LaTeX.
        return bool(verify(parse("\\boxed{" + answer + "}"), parse(text)))
    except Exception:  # math-verify raises on pathological inputs (and times out): count as wrong
        return False


def token_counter(tokenizer) -> TokenCounter:
    """Counts tokens as the student will see them: the tokenizer alone, no special tokens added."""

    def count(texts: Sequence[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    return count


def _as_text(value) -> Optional[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # some exports store numeric answers as numbers
    return None


def _bool_list(row: dict, key: str, n: int) -> tuple[Optional[list], Optional[str]]:
    """A per-generation flag list: None when absent; an error reason when its shape is wrong."""
    value = row.get(key)
    if value is None:
        return None, None
    if not isinstance(value, (list, tuple)) or len(value) != n:
        return None, f"{key} is not a list as long as generations"
    if any(v is not None and not isinstance(v, bool) for v in value):
        return None, f"{key} holds non-boolean values"
    return list(value), None


def select_golden(
    row: dict, answer: str, filt: FilterConfig, count_tokens: Optional[TokenCounter], outcomes: Counter
) -> tuple[Optional[str], Optional[int], Optional[str]]:
    """(golden, its token count, None) for a raw OpenR1-Math row, (None, None, reason) when no generation
    survives the filter or the row's generation columns are malformed. `outcomes` counts each
    generation's fate."""
    gens = row.get("generations")
    if not isinstance(gens, (list, tuple)) or any(not isinstance(g, str) for g in gens):
        return None, None, "generations is not a list of strings"
    correct, err = _bool_list(row, "correctness_math_verify", len(gens))
    if err:
        return None, None, err
    complete, err = _bool_list(row, "is_reasoning_complete", len(gens))
    if err:
        return None, None, err

    candidates = []
    for i, gen in enumerate(gens):
        if not gen.strip():
            outcomes["empty"] += 1
            continue
        if filt.require_complete and complete is not None and complete[i] is False:
            outcomes["incomplete"] += 1
            continue
        if filt.require_math_verify:
            judged = None if (filt.reverify or correct is None) else correct[i]
            ok = answer_matches(answer, gen) if judged is None else judged
            if not ok:
                outcomes["wrong (math-verify)"] += 1
                continue
        candidates.append(gen)

    if not candidates:
        return None, None, "no verified generation"
    if count_tokens is None:
        if filt.max_generation_tokens or filt.golden_choice == "shortest":
            raise ValueError(
                "select_golden needs count_tokens when max_generation_tokens > 0 or "
                "golden_choice=shortest: pass a tokenizer"
            )
        outcomes["kept"] += 1
        return candidates[0], None, None
    # Counting tokens is the expensive part (traces run to 16k tokens): with golden_choice=first only the
    # candidates up to the first short-enough one are tokenized.
    lengths: list[int] = []
    chosen = None
    for gen in candidates:
        n = int(count_tokens([gen])[0])
        lengths.append(n)
        if filt.max_generation_tokens and n > filt.max_generation_tokens:
            outcomes[f"over {filt.max_generation_tokens} tokens"] += 1
            continue
        if chosen is None or (filt.golden_choice == "shortest" and n < lengths[chosen]):
            chosen = len(lengths) - 1
        if filt.golden_choice == "first":
            break
    if chosen is None:
        return None, None, f"no verified generation within {filt.max_generation_tokens} tokens"
    outcomes["kept"] += 1
    return candidates[chosen], lengths[chosen], None


def record_from_row(
    row: dict, filt: FilterConfig, count_tokens: Optional[TokenCounter], outcomes: Counter
) -> tuple[Optional[GoldenRecord], Optional[str]]:
    """A GoldenRecord from a row of any accepted format, or (None, reason) for a row to skip."""
    problem = row.get("problem")
    if not isinstance(problem, str):
        return None, "missing problem"
    if not problem.strip():
        return None, "empty problem"
    answer = _as_text(row.get("answer"))
    if answer is None or not answer.strip():
        return None, "missing answer"
    uuid = _as_text(row.get("uuid")) or _as_text(row.get("id"))
    if not uuid:
        # A stable id from the content: the same row gets the same id in every run.
        uuid = hashlib.sha1(problem.encode("utf-8")).hexdigest()[:16]
    source = _as_text(row.get("source")) or ""

    if "golden" in row:  # the prepared format: the filter already ran
        golden = row["golden"]
        if golden is not None and not isinstance(golden, str):
            return None, "golden is not a string"
        n = row.get("golden_tokens")
        return GoldenRecord(
            uuid, problem, answer, source, golden or None, int(n) if isinstance(n, int) and golden else None
        ), None
    if "generations" in row:
        golden, n, reason = select_golden(row, answer, filt, count_tokens, outcomes)
        if reason:
            return None, reason
        return GoldenRecord(uuid, problem, answer, source, golden, n), None
    return GoldenRecord(uuid, problem, answer, source), None  # prompt-only (validation sets)


def load_records(
    files: Sequence[str],
    filt: FilterConfig,
    count_tokens: Optional[TokenCounter],
    report: LoadReport,
    require_golden: bool = False,
    max_rows: int = 0,
    non_utf8: str = "refuse",
) -> list[GoldenRecord]:
    """Reads every row of `files` into GoldenRecords, skipping and counting (in `report`) what is unusable."""
    from megaopd.data.io import iter_rows

    report.files = list(files)
    records: list[GoldenRecord] = []
    for loc, row in iter_rows(files, non_utf8):
        report.rows += 1
        if isinstance(row, str):
            report.skip(loc, row)
            continue
        rec, reason = record_from_row(row, filt, count_tokens, report.generations)
        if rec is not None and require_golden and rec.golden is None:
            reason = "no golden solution"
        if reason:
            report.skip(loc, reason)
            continue
        records.append(rec)
        report.kept += 1
        if max_rows and len(records) >= max_rows:
            break
    return records


def split_sizes(n: int, sizes: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """The part sizes for n records: as asked when n suffices (the rest is left out); otherwise scaled down
    in proportion (largest remainder), e.g. n=46 with [(sft, 33000), (opd, 13000)] -> [(sft, 33), (opd, 13)]."""
    asked = sum(s for _, s in sizes)
    if any(s < 0 for _, s in sizes) or asked == 0:
        raise ValueError(f"split sizes {sizes} must be non-negative with a positive total")
    if n >= asked:
        return list(sizes)
    exact = [n * s / asked for _, s in sizes]
    got = [int(x) for x in exact]
    # Hand the remaining records to the parts with the largest fractional parts (ties: earlier part).
    order = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - got[i]), i))
    for i in order[: n - sum(got)]:
        got[i] += 1
    return [(name, g) for (name, _), g in zip(sizes, got)]


def split_records(records: Sequence, sizes: Sequence[tuple[str, int]], seed: int) -> dict[str, list]:
    """Shuffles with `seed` and cuts consecutive parts: the same records and seed give the same split."""
    order = list(range(len(records)))
    random.Random(f"megaopd-split/{seed}").shuffle(order)  # str seeds are hashed with sha512: stable
    parts, start = {}, 0
    for name, size in split_sizes(len(records), sizes):
        parts[name] = [records[i] for i in order[start : start + size]]
        start += size
    return parts


def approx_token_counter(texts: Sequence[str]) -> list[int]:
    """ceil(UTF-8 bytes / 4): a tokenizer-free stand-in (English + LaTeX run ~3.5-4.5 bytes per Qwen token)
    for when no tokenizer is at hand; prepare with --tokenizer to reproduce the paper's filter exactly."""
    return [-(-len(t.encode("utf-8")) // 4) for t in texts]


def prepare_splits(
    files: Sequence[str],
    filt: FilterConfig,
    count_tokens: Optional[TokenCounter],
    sizes: Sequence[tuple[str, int]],
    seed: int,
    limit: int = 0,
    progress: Optional[Callable[[LoadReport], None]] = None,
) -> tuple[dict[str, list[GoldenRecord]], LoadReport]:
    """The paper's data pipeline: filter raw OpenR1-Math rows to prompts with a verified golden, then split
    them (seeded) into parts of the given sizes (scaled down in proportion when fewer survive).

    Raises DataError naming the files when no row survives."""
    report = LoadReport(name="openr1-math")
    records = load_records(files, filt, count_tokens, report, require_golden=True, max_rows=limit)
    if progress is not None:
        progress(report)
    report.raise_if_empty(
        "pass the OpenR1-Math-220k parquet files (data/train-*.parquet of the default "
        "config) or .jsonl rows with problem, answer, generations and "
        "correctness_math_verify; check --max-tokens"
    )
    return split_records(records, sizes, seed), report
