"""Prepare OpenR1-Math-220k for megaopd: the paper's golden filter and its 33k SFT / 13k OPD split.

    python tools/prepare_openr1_math.py --input /data/OpenR1-Math-220k/data --out data/openr1 \
        --tokenizer /models/Qwen2.5-Math-1.5B
    # -> data/openr1/sft.parquet (33k), data/openr1/opd.parquet (13k), data/openr1/manifest.json

Input: the default config's parquet shards (93,733 rows), any .parquet/.jsonl/.json files or directories
in the OpenR1-Math schema (megaopd/data/openr1.py). A generation is kept when math-verify judged it correct
(correctness_math_verify; --reverify runs math-verify again), it is at most --max-tokens tokens of
--tokenizer (paper: 8192; without --tokenizer, ceil(bytes / 4) approximates it) and its reasoning is
complete; a prompt with a kept generation becomes a row with that golden (paper: ~46k of 94k). Rows are
shuffled with --seed and cut into --sizes (scaled down in proportion when fewer survive). Malformed rows
are skipped and counted in manifest.json with the reason and where the first one was.

Output rows (parquet or jsonl): uuid, problem, answer, source, golden, golden_tokens. Point
data.sources[].path at sft.* for the cold-start SFT and at opd.* for OPD.

Run time: dominated by tokenizing the traces (~200k generations of up to 16k tokens): tens of minutes on
one CPU core for the full set; --limit N for a quick look.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaopd.data.config import FilterConfig, resolve_data_files  # noqa: E402
from megaopd.data.io import write_rows  # noqa: E402
from megaopd.data.openr1 import DataError, approx_token_counter, prepare_splits, token_counter  # noqa: E402

DEFAULT_SIZES = "sft=33000,opd=13000"


def parse_sizes(text: str) -> list[tuple[str, int]]:
    try:
        sizes = [(k.strip(), int(v)) for k, v in (p.split("=") for p in text.split(","))]
    except ValueError:
        raise SystemExit(f"--sizes {text!r}: write name=count pairs, e.g. {DEFAULT_SIZES}") from None
    if any(n < 0 for _, n in sizes) or not sum(n for _, n in sizes):
        raise SystemExit(f"--sizes {text!r}: counts must be non-negative with a positive total")
    return sizes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help="files, directories or globs")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer directory that counts tokens")
    ap.add_argument("--max-tokens", type=int, default=8192, help="drop longer generations; 0 = no limit")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="part=rows pairs (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    ap.add_argument("--reverify", action="store_true", help="run math-verify instead of trusting the column")
    ap.add_argument("--golden-choice", choices=("first", "shortest"), default="first")
    ap.add_argument("--keep-incomplete", action="store_true", help="keep is_reasoning_complete=false traces")
    ap.add_argument("--limit", type=int, default=0, help="stop after N kept rows (quick look)")
    args = ap.parse_args(argv)

    files = [f for spec in args.input for f in resolve_data_files(spec)]
    missing = [spec for spec in args.input if not resolve_data_files(spec)]
    if missing:
        print(
            f"error: --input {missing[0]!r} matches no .parquet/.jsonl/.json file: download OpenR1-Math-220k "
            f"(huggingface.co/datasets/open-r1/OpenR1-Math-220k, data/train-*.parquet) and point --input "
            f"at it",
            file=sys.stderr,
        )
        return 2
    if args.tokenizer:
        from transformers import AutoTokenizer

        counter = token_counter(AutoTokenizer.from_pretrained(args.tokenizer))
        unit = f"tokens of {args.tokenizer}"
    else:
        counter = approx_token_counter
        unit = "approximate tokens, ceil(utf-8 bytes / 4)"
        print("warning: no --tokenizer; generation lengths are approximated as ceil(bytes / 4)", file=sys.stderr)
    filt = FilterConfig(
        max_generation_tokens=args.max_tokens,
        reverify=args.reverify,
        require_complete=not args.keep_incomplete,
        golden_choice=args.golden_choice,
    )
    sizes = parse_sizes(args.sizes)

    t0 = time.time()
    try:
        parts, report = prepare_splits(files, filt, counter, sizes, args.seed, limit=args.limit)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    for name, records in parts.items():
        write_rows(os.path.join(args.out, f"{name}.{args.format}"), [r.to_row() for r in records])
    manifest = {
        "inputs": files,
        "rows_read": report.rows,
        "rows_kept": report.kept,
        "skipped": dict(report.skipped.most_common()),
        "first_skipped": report.first_skipped,
        "generations": dict(sorted(report.generations.items())),
        "filter": {
            "max_generation_tokens": args.max_tokens,
            "length_unit": unit,
            "reverify": args.reverify,
            "require_complete": not args.keep_incomplete,
            "golden_choice": args.golden_choice,
        },
        "sizes_asked": dict(sizes),
        "sizes": {k: len(v) for k, v in parts.items()},
        "left_out": report.kept - sum(len(v) for v in parts.values()),
        "seed": args.seed,
        "format": args.format,
        "limit": args.limit,
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    print(report.summary())
    print(f"wrote {manifest['sizes']} to {args.out} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
