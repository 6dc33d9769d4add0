"""One table from several evaluations: a row per checkpoint, the benchmarks as columns in the paper's
order (MATH-500, Minerva, OlympiadBench, AMC, AIME24, AIME25, then any others), and Avg.

    python -m megaopd.eval.table EVAL_DIR [EVAL_DIR ...] [--out DIR]
        each EVAL_DIR holds results.json (megaopd eval --out EVAL_DIR); prints the table; with --out,
        writes DIR/results.md and DIR/results.json ({"columns", "rows": [{"label", "accuracy": {...}, "average"}]})

Accuracy in percent with one decimal, as in `megaopd eval`'s own table; a benchmark a row lacks is "-".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

from megaopd.eval.benchmarks import BENCHMARKS


@dataclass
class Row:
    label: str
    accuracy: dict[str, float]
    """Display name of a benchmark -> accuracy in [0, 1]."""
    average: float
    """The evaluation's own Avg (mean over the benchmarks it evaluated)."""
    source: str


def read_row(eval_dir: str) -> Row:
    path = os.path.join(eval_dir, "results.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: is {eval_dir} the --out folder of a finished `megaopd eval`?")
    with open(path) as f:
        r = json.load(f)
    return Row(
        label=r["label"],
        accuracy={b["display"]: b["accuracy"] for b in r["benchmarks"]},
        average=r["average"],
        source=eval_dir,
    )


def column_order(rows: list[Row]) -> list[str]:
    paper = [s.display for s in BENCHMARKS.values()]
    seen = [c for r in rows for c in r.accuracy]
    return [c for c in paper if c in seen] + list(dict.fromkeys(c for c in seen if c not in paper))


def markdown(rows: list[Row]) -> str:
    cols = column_order(rows)
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    lines = ["| Model | " + " | ".join(cols) + " | Avg |", "|---|" + "---:|" * (len(cols) + 1)]
    for r in rows:
        lines.append(f"| {r.label} | " + " | ".join(pct(r.accuracy.get(c)) for c in cols) + f" | {pct(r.average)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megaopd.eval.table", description=__doc__.splitlines()[0])
    ap.add_argument("eval_dirs", nargs="+", help="--out folders of `megaopd eval` runs, one row each")
    ap.add_argument("--out", default=None, help="folder for the combined results.md and results.json")
    args = ap.parse_args(argv)
    try:
        rows = [read_row(d) for d in args.eval_dirs]
    except (FileNotFoundError, KeyError, json.JSONDecodeError) as e:
        print(f"megaopd eval table: {e}", file=sys.stderr)
        return 2
    md = markdown(rows)
    print(md, end="")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(md)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"columns": column_order(rows) + ["Avg"], "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
