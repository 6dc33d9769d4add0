"""Cross-tokenizer alignment cost per step: re-tokenizing the student's responses with the teacher's tokenizer
and aligning them by characters (megaopd.data.alignment), against the same-tokenizer path, which does none
of it (0 s: the teacher scores the student's ids as they are).

Responses: the golden solutions of examples/tiny/data/opd.jsonl (their `generations`, the think block
included), as many as a step holds. Per step and per response, on the host, one thread:
    decode   decode_with_offsets(student tokenizer, ids): the response text and each token's characters
    retok    retokenize(text, teacher tokenizer): the teacher's ids and offsets
    align    align_by_chars: the spans
    spread   spread_span_logprobs of a random teacher log-prob vector: the student tokens' values
Pairs: the tiny student's tokenizer -> the tiny teacher_xtok's (examples/tiny/tokenizer_xtok), and SmolLM2's
byte-level BPE (49,152 ids, when cached) -> teacher_xtok's. Shapes: the tiny study's step (16 prompts x 4
samples) and a long one (8 responses of about 4,000 student tokens: several goldens joined), to see that the
cost grows linearly in tokens. Time = median of --repeats steps, in CPU seconds of the process
(time.process_time: all its threads, the tokenizers' Rust ones included), which a machine shared with other
jobs inflates far less than wall time; the wall time of the whole step is printed beside it.

    python benchmarks/alignment.py            # prints the table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megaopd.data.alignment import align_by_chars, decode_with_offsets, retokenize, spread_span_logprobs  # noqa: E402
from megaopd.models.hf_io import load_tokenizer  # noqa: E402

TINY = os.path.join(ROOT, "examples", "tiny", "tokenizer")
XTOK = os.path.join(ROOT, "examples", "tiny", "tokenizer_xtok")
SMOLLM2 = os.path.expanduser("~/.cache/megaopd/models/SmolLM2-135M-Instruct")


def responses(n: int, join: int = 1) -> list[str]:
    """n response texts, each `join` golden generations one after another."""
    with open(os.path.join(ROOT, "examples", "tiny", "data", "opd.jsonl")) as f:
        gens = [json.loads(line)["generations"][0] for line in f if line.strip()]
    return ["\n".join(gens[(i * join + k) % len(gens)] for k in range(join)) for i in range(n)]


def one_step(student, teacher, batch_ids: list[list[int]]) -> dict[str, float]:
    """Seconds of each stage summed over the step's responses, and the token and span counts."""
    times = dict(decode=0.0, retok=0.0, align=0.0, spread=0.0)
    counts = dict(student_tokens=0, teacher_tokens=0, spans=0)
    g = torch.Generator().manual_seed(0)
    wall = time.perf_counter()
    clock = time.process_time
    for ids in batch_ids:
        t0 = clock()
        text, s_off = decode_with_offsets(student, ids)
        t1 = clock()
        t_ids, t_off = retokenize(text, teacher)
        t2 = clock()
        al = align_by_chars(s_off, t_off)
        t3 = clock()
        lp = -torch.rand(len(t_ids), generator=g)
        t4 = clock()
        spread_span_logprobs(lp, al)
        t5 = clock()
        times["decode"] += t1 - t0
        times["retok"] += t2 - t1
        times["align"] += t3 - t2
        times["spread"] += t5 - t4
        counts["student_tokens"] += len(ids)
        counts["teacher_tokens"] += len(t_ids)
        counts["spans"] += al.n_spans
    return {**times, **counts, "wall": time.perf_counter() - wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    xtok = load_tokenizer(XTOK)
    students = {"tiny (256)": load_tokenizer(TINY)}
    if os.path.isfile(os.path.join(SMOLLM2, "tokenizer.json")):
        students["SmolLM2 (49152)"] = load_tokenizer(SMOLLM2)
    shapes = {"tiny study: 64 x golden": responses(64), "long: 8 x ~4k tokens": responses(8, join=40)}
    print(
        "| student -> teacher_xtok (384) | step | responses | student tokens | teacher tokens | spans | "
        "decode ms | retok ms | align ms | spread ms | total CPU ms | us / student token | wall ms | same tokenizer |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s_name, student in students.items():
        for shape, texts in shapes.items():
            batch_ids = [student.encode(t, add_special_tokens=False) + [student.eos_token_id] for t in texts]
            runs = [one_step(student, xtok, batch_ids) for _ in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in ("decode", "retok", "align", "spread")}
            wall = statistics.median(r["wall"] for r in runs)
            total = sum(med.values())
            n = runs[0]["student_tokens"]
            print(
                f"| {s_name} | {shape} | {len(texts)} | {n} | {runs[0]['teacher_tokens']} | {runs[0]['spans']} | "
                + " | ".join(f"{1e3 * med[k]:.1f}" for k in ("decode", "retok", "align", "spread"))
                + f" | {1e3 * total:.1f} | {1e6 * total / n:.1f} | {1e3 * wall:.1f} | 0 |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
