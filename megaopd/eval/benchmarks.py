"""Benchmark suites: the local file format, the six paper benchmarks, and conversion of public releases.

Local format (one file per benchmark, `<data_dir>/<name>.jsonl`, UTF-8, one JSON object per line):
    {"id": "math500-0", "problem": "What is $1+1$?", "answer": "2"}
- id: unique within the file (string; defaults to "<name>-<line index>" when absent);
- problem: the question as shown to the model (LaTeX allowed);
- answer: the gold final answer as a string, the content of a \\boxed{} (e.g. "\\frac{1}{2}", "(1, 2)").
`tools/prepare_benchmarks.py` writes these files from the public releases (see `convert_rows`).

Default protocol (paper 2604.08527): MATH-500, Minerva, OlympiadBench pass@1 (one sample per problem);
AMC, AIME24, AIME25 avg@32 (mean accuracy over 32 samples per problem); temperature 0.6.
Both are the same estimator, mean over problems of the mean correctness over k samples; the names say k.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable

from megaopd.metrics.reward import last_boxed


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    """Short name used on the command line and as the file stem."""
    display: str
    """Column title in result tables (the paper's spelling)."""
    samples: int
    """Default samples per problem: 1 -> pass@1, k > 1 -> avg@k."""


# The paper's column order; results tables follow it, then any extra files in the order given.
BENCHMARKS: dict[str, BenchmarkSpec] = {
    s.name: s
    for s in (
        BenchmarkSpec("math500", "MATH-500", 1),
        BenchmarkSpec("minerva", "Minerva", 1),
        BenchmarkSpec("olympiadbench", "OlympiadBench", 1),
        BenchmarkSpec("amc", "AMC", 32),
        BenchmarkSpec("aime24", "AIME24", 32),
        BenchmarkSpec("aime25", "AIME25", 32),
    )
}
DEFAULT_DATA_DIR = os.environ.get("MEGAOPD_BENCHMARK_DIR", os.path.join("data", "benchmarks"))


@dataclass
class Problem:
    id: str
    problem: str
    answer: str


@dataclass
class Benchmark:
    name: str
    problems: list[Problem]
    samples: int = 1
    display: str = ""
    source: str = ""
    """The file it was read from (for messages)."""

    def __post_init__(self):
        self.display = self.display or (BENCHMARKS[self.name].display if self.name in BENCHMARKS else self.name)
        if self.samples < 1:
            raise ValueError(f"benchmark {self.name}: samples={self.samples} must be at least 1")

    @property
    def metric_name(self) -> str:
        return "pass@1" if self.samples == 1 else f"avg@{self.samples}"


def load_benchmark_file(path: str, name: str | None = None, samples: int | None = None) -> Benchmark:
    """Reads a local-format jsonl; raises ValueError naming the file, line and field on bad input."""
    name = name or os.path.splitext(os.path.basename(path))[0]
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"benchmark {name}: {path} not found; create it with `python tools/prepare_benchmarks.py` "
            f"or pass --data-dir (format: megaopd/eval/benchmarks.py)"
        )
    problems, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            where = f"{path}:{i + 1}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object with problem and answer")
            for key in ("problem", "answer"):
                if not isinstance(row.get(key), (str, int, float)) or not str(row[key]).strip():
                    raise ValueError(f'{where}: missing or empty "{key}"; the format is {{"id", "problem", "answer"}}')
            pid = str(row.get("id", f"{name}-{i}"))
            if pid in seen:
                raise ValueError(f"{where}: duplicate id {pid!r}")
            seen.add(pid)
            problems.append(Problem(pid, str(row["problem"]), str(row["answer"])))
    if not problems:
        raise ValueError(f"benchmark {name}: {path} holds no problems")
    default = BENCHMARKS[name].samples if name in BENCHMARKS else 1
    return Benchmark(name, problems, samples or default, source=path)


def resolve_benchmarks(
    names: Iterable[str | Benchmark], data_dir: str | None = None, samples: int | None = None
) -> list[Benchmark]:
    """Names of registered benchmarks (read from data_dir/<name>.jsonl) or paths to .jsonl files, or
    Benchmark objects; `samples` overrides every benchmark's default. Registered ones come back in the
    paper's column order, then the others in the order given."""
    data_dir = data_dir or DEFAULT_DATA_DIR
    out = []
    for item in names:
        if isinstance(item, Benchmark):
            b = item
            if samples:
                b = Benchmark(b.name, b.problems, samples, b.display, b.source)
        elif item.endswith(".jsonl"):
            b = load_benchmark_file(item, samples=samples)
        elif item in BENCHMARKS:
            b = load_benchmark_file(os.path.join(data_dir, f"{item}.jsonl"), item, samples)
        else:
            raise ValueError(
                f"unknown benchmark {item!r}: use one of {', '.join(BENCHMARKS)} or a path to a .jsonl file"
            )
        out.append(b)
    order = list(BENCHMARKS)
    return sorted(out, key=lambda b: order.index(b.name) if b.name in order else len(order))


# ---- conversion of public releases (used by tools/prepare_benchmarks.py) ----

PROBLEM_COLUMNS = ("problem", "question", "Problem", "Question", "query")
"""Tried in order: MATH-500 / AIME (problem), Minerva / OlympiadBench / AMC23 releases (question)."""
ANSWER_COLUMNS = ("answer", "final_answer", "Answer", "gt_answer", "expected_answer")
"""Tried in order; OlympiadBench's final_answer is a list of strings (joined with ", ")."""
SOLUTION_COLUMNS = ("solution", "Solution", "response")
"""Used when no answer column exists: the gold answer is the solution's last \\boxed{}."""
ID_COLUMNS = ("id", "unique_id", "idx", "ID", "problem_id")


def _answer_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        parts = [_answer_text(v) for v in value]
        parts = [p for p in parts if p]
        return ", ".join(parts) if parts else None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # AMC releases store 12.0
    text = str(value).strip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    return text or None


def convert_rows(
    rows: list[dict[str, Any]],
    name: str,
    source: str = "",
    problem_column: str | None = None,
    answer_column: str | None = None,
) -> list[dict[str, str]]:
    """Public-release rows -> local-format rows. Raises ValueError naming the columns it found when the
    problem or answer column is missing, or the row whose answer cannot be found. The *_column
    arguments override the guesses (an answer column may hold a bare answer or a boxed solution)."""
    if not rows:
        raise ValueError(f"{name}: {source or 'input'} has no rows")
    columns = list(rows[0].keys())
    for given in (problem_column, answer_column):
        if given is not None and given not in columns:
            raise ValueError(f"{name}: column {given!r} not in {source or 'input'} (found {', '.join(columns)})")
    pcol = problem_column or next((c for c in PROBLEM_COLUMNS if c in columns), None)
    acol = answer_column or next((c for c in ANSWER_COLUMNS if c in columns), None)
    scol = next((c for c in SOLUTION_COLUMNS if c in columns), None)
    icol = next((c for c in ID_COLUMNS if c in columns), None)
    if pcol is None:
        raise ValueError(
            f"{name}: {source or 'input'} has no problem column (looked for {', '.join(PROBLEM_COLUMNS)}; "
            f"found {', '.join(columns)}); pass --problem-column"
        )
    if acol is None and scol is None:
        raise ValueError(
            f"{name}: {source or 'input'} has no answer column (looked for {', '.join(ANSWER_COLUMNS)}, or a "
            f"solution with \\boxed{{}} in {', '.join(SOLUTION_COLUMNS)}; found {', '.join(columns)}); pass "
            f"--answer-column"
        )
    out, seen = [], set()
    for i, row in enumerate(rows):
        answer = _answer_text(row.get(acol)) if acol else None
        if answer is not None and last_boxed(answer) is not None:  # a solution given as the answer column
            answer = last_boxed(answer)
        if answer is None and scol and isinstance(row.get(scol), (str, list)):
            sol = row[scol] if isinstance(row[scol], str) else "\n".join(map(str, row[scol]))
            answer = last_boxed(sol)
        if not answer:
            raise ValueError(f"{name}: row {i} of {source or 'input'} has no answer (column {acol or scol})")
        problem = row.get(pcol)
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError(f"{name}: row {i} of {source or 'input'} has an empty {pcol!r}")
        pid = f"{name}-{row[icol]}" if icol and row.get(icol) is not None else f"{name}-{i}"
        if pid in seen:  # some releases repeat ids across splits
            pid = f"{pid}-{i}"
        seen.add(pid)
        out.append({"id": pid, "problem": problem.strip(), "answer": answer})
    return out


def read_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a local release file: .jsonl, .json (a list of objects, or {"data"|"test"|"train": [...]}) or
    .parquet. Never unpickles."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()  # list columns come back as Python lists
    with open(path, encoding="utf-8") as f:
        if ext == ".jsonl":
            rows = []
            for i, line in enumerate(f):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{i + 1}: not JSON ({e.msg})") from None
            return rows
        if ext == ".json":
            data = json.load(f)
            if isinstance(data, dict):
                data = next((data[k] for k in ("data", "test", "train") if isinstance(data.get(k), list)), None)
            if not isinstance(data, list):
                raise ValueError(f"{path}: expected a JSON list of objects (or one under data/test/train)")
            return data
    raise ValueError(f"{path}: unsupported file type {ext!r}; use .jsonl, .json or .parquet")


def write_benchmark_file(rows: list[dict[str, str]], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
