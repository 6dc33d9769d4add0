"""Build the tiny CPU data world: synthetic math problems (OpenR1-Math schema) and a 256-id tokenizer.

    python tools/build_tiny_data.py            # writes examples/tiny/data/{sft,opd,val}.jsonl (+ opd split into
                                               #    arithmetic/algebra.jsonl) + README.md
                                               #    and examples/tiny/tokenizer/ (HF format)
    python tools/build_tiny_data.py --check    # rebuilds into a temp dir; exit 1 unless byte-identical (CI)

Run time on a shared 2-core CPU: 15-20 s to build, the same for --check (math-verify judging ~7000
generations, and the BPE training). The library code is megaopd/data/synthetic.py; the files are deterministic given
--seed and the sizes (and the versions of tokenizers/transformers that serialize the tokenizer).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaopd.data.io import write_rows  # noqa: E402
from megaopd.data.synthetic import build_tokenizer, generate_splits, save_tokenizer, tokenizer_corpus  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(ROOT, "examples", "tiny", "data")
DEFAULT_TOKENIZER = os.path.join(ROOT, "examples", "tiny", "tokenizer")
DEFAULT_SIZES = "sft=4000,opd=2000,val=200"

README = """# Tiny synthetic math data (generated: do not edit)

Built by `python tools/build_tiny_data.py --seed {seed} --sizes {sizes}`; `--check` verifies these files.
Rows follow the OpenR1-Math-220k schema (see megaopd/data/openr1.py); the golden filter of megaopd.data
picks each row's verified generation on load.

| file | rows | rows with a wrong 2nd generation | use |
| --- | --- | --- | --- |
{table}

Problem kinds: integer expressions with 2-4 operations, a*x+b=c, a*x+b=c*x+d, two/three-step word
problems. Generations: `<think>` steps `</think>` then `The answer is \\boxed{{N}}.`; every one judged by
math-verify (correctness_math_verify). Tokenizer: ../tokenizer (256 ids, EOS <|im_end|>, pad <|endoftext|>).
val.jsonl also reads as a benchmark file of megaopd.eval (it has `problem` and `answer`).
"""
USES = {
    "sft": "cold-start SFT on golden solutions",
    "opd": "OPD prompts (+ golden for mixture distillation)",
    "val": "validation (answers)",
}


def parse_sizes(text: str) -> list[tuple[str, int]]:
    try:
        sizes = [(k.strip(), int(v)) for k, v in (part.split("=") for part in text.split(","))]
    except ValueError:
        raise SystemExit(f"--sizes {text!r}: write name=count pairs, e.g. {DEFAULT_SIZES}") from None
    if any(n < 1 for _, n in sizes):
        raise SystemExit(f"--sizes {text!r}: every count must be positive")
    return sizes


def build(data_dir: str, tokenizer_dir: str, seed: int, sizes: list[tuple[str, int]]) -> dict[str, int]:
    splits = generate_splits(sizes, seed=seed)
    os.makedirs(data_dir, exist_ok=True)
    for name, rows in splits.items():
        write_rows(os.path.join(data_dir, f"{name}.jsonl"), rows)
    # The OPD prompts split by kind, two data sources of the two-teacher preset (examples/tiny/two_teachers.yaml).
    for kind, file in (("Arithmetic", "arithmetic"), ("Algebra", "algebra")) if "opd" in splits else ():
        write_rows(os.path.join(data_dir, f"{file}.jsonl"), [r for r in splits["opd"] if r["problem_type"] == kind])
    table = "\n".join(
        f"| {name}.jsonl | {len(rows)} | {sum(len(r['generations']) > 1 for r in rows)} | {USES.get(name, '')} |"
        for name, rows in splits.items()
    )
    sizes_text = ",".join(f"{k}={v}" for k, v in sizes)
    with open(os.path.join(data_dir, "README.md"), "w", newline="\n") as f:
        f.write(README.format(seed=seed, sizes=sizes_text, table=table))
    # The tokenizer sees every split: validation text must not tokenize to <|unk|>.
    corpus = tokenizer_corpus([r for rows in splits.values() for r in rows])
    tok = build_tokenizer(corpus)
    save_tokenizer(tok, tokenizer_dir)
    return {name: len(rows) for name, rows in splits.items()}


def compare_dirs(expected: str, actual: str) -> list[str]:
    """Differences between two directories' files: missing, extra, or different bytes."""
    problems = []
    want = set(os.listdir(expected)) if os.path.isdir(expected) else set()
    got = set(os.listdir(actual))
    problems += [f"{os.path.join(expected, f)} is missing" for f in sorted(got - want)]
    problems += [f"{os.path.join(expected, f)} is not produced by the generator" for f in sorted(want - got)]
    for f in sorted(want & got):
        if not filecmp.cmp(os.path.join(expected, f), os.path.join(actual, f), shallow=False):
            problems.append(f"{os.path.join(expected, f)} differs from a fresh build")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=DEFAULT_DATA)
    ap.add_argument("--tokenizer-dir", default=DEFAULT_TOKENIZER)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="split=rows pairs (default %(default)s)")
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare bytes")
    args = ap.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    t0 = time.time()
    if not args.check:
        counts = build(args.data_dir, args.tokenizer_dir, args.seed, sizes)
        print(f"wrote {counts} to {args.data_dir} and the tokenizer to {args.tokenizer_dir} in {time.time() - t0:.1f}s")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        data_tmp, tok_tmp = os.path.join(tmp, "data"), os.path.join(tmp, "tokenizer")
        build(data_tmp, tok_tmp, args.seed, sizes)
        problems = compare_dirs(args.data_dir, data_tmp) + compare_dirs(args.tokenizer_dir, tok_tmp)
    if problems:
        print(
            "tiny data check FAILED:\n  "
            + "\n  ".join(problems)
            + "\nfix: run `python tools/build_tiny_data.py` and commit the files (or revert the generator "
            "change)",
            file=sys.stderr,
        )
        return 1
    print(f"tiny data check passed ({time.time() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
