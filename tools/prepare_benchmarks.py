"""Convert the public releases of the six math benchmarks into megaopd's local format.

    python tools/prepare_benchmarks.py --out data/benchmarks math500=path/to/test.jsonl aime24=aime.parquet
    python tools/prepare_benchmarks.py --out data/benchmarks math500 aime24     # from the Hub (network)

Each argument is NAME or NAME=SOURCE; SOURCE is a local .jsonl / .json / .parquet file or a Hugging Face
dataset id (optionally ID:CONFIG:SPLIT). NAME alone uses the release in KNOWN_SOURCES. Writes
OUT/NAME.jsonl with {"id", "problem", "answer"} per line (format: megaopd/eval/benchmarks.py).
Columns are found by their usual names (problem/question/Problem, answer/final_answer/Answer, or the last
\\boxed{} of solution); --problem-column / --answer-column override, and a missing column is one error
that lists the columns the file has.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaopd.eval.benchmarks import BENCHMARKS, convert_rows, read_rows, write_benchmark_file  # noqa: E402

# Releases commonly used for these numbers (Hub id, config, split). Problem counts in comments.
KNOWN_SOURCES = {
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),  # 500; problem, solution, answer, unique_id
    "minerva": ("math-ai/minervamath", None, "test"),  # 272; question, answer
    "olympiadbench": ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),  # 675; question, final_answer (list)
    "amc": ("AI-MO/aimo-validation-amc", None, "train"),  # 83; problem, answer (float)
    "aime24": ("HuggingFaceH4/aime_2024", None, "train"),  # 30; problem, solution, answer
    "aime25": ("math-ai/aime25", None, "test"),  # 30; problem, answer, id
}


def load_source(source: str) -> list[dict]:
    if os.path.exists(source):
        return read_rows(source)
    if source.endswith((".jsonl", ".json", ".parquet")):
        raise FileNotFoundError(f"{source} not found")
    repo, config, split = (source.split(":") + [None, None])[:3]
    try:
        from datasets import load_dataset

        ds = load_dataset(repo, config or None, split=split or "test")
    except Exception as e:  # noqa: BLE001 - offline machines, typos: one line with the fix
        raise SystemExit(
            f"prepare_benchmarks: cannot load {source!r} from the Hub ({type(e).__name__}: {e}); download the "
            f"release and pass NAME=path/to/file.jsonl|.parquet"
        ) from None
    return [dict(r) for r in ds]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("items", nargs="+", metavar="NAME[=SOURCE]")
    ap.add_argument("--out", default=os.path.join("data", "benchmarks"))
    ap.add_argument("--problem-column", default=None)
    ap.add_argument("--answer-column", default=None)
    args = ap.parse_args(argv)
    for item in args.items:
        name, _, source = item.partition("=")
        if not source:
            if name not in KNOWN_SOURCES:
                print(f"prepare_benchmarks: no known release for {name!r}; pass {name}=FILE", file=sys.stderr)
                return 2
            repo, config, split = KNOWN_SOURCES[name]
            source = ":".join([repo, config or "", split])
        try:
            rows = convert_rows(load_source(source), name, source, args.problem_column, args.answer_column)
        except (ValueError, FileNotFoundError) as e:
            print(f"prepare_benchmarks: {e}", file=sys.stderr)
            return 2
        path = os.path.join(args.out, f"{name}.jsonl")
        write_benchmark_file(rows, path)
        note = "" if name in BENCHMARKS else " (not a registered benchmark: pass the file path to megaopd eval)"
        print(f"{name}: {len(rows)} problems -> {path}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
