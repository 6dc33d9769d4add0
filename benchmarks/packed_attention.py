"""Packed-row attention on CPU: one causal SDPA call per sequence (the code before) vs the sequences batched by
length (megaopd.models.packed_attention.causal_by_length), forward + backward, in one run.

Rows of three length mixes (the tiny demo's, a long-tailed one, many short ones), the tiny models' head layout
(4 query heads on 2 KV heads, head_dim 24) at TP=1 and TP=2 (half the heads per rank); one torch thread, the
two arms alternating, median of --reps.

    python benchmarks/packed_attention.py [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MIXES = {  # name: (shortest, longest, sequences in the row)
    "tiny demo (120-190 tokens)": (120, 190, 110),
    "long-tailed (20-600)": (20, 600, 40),
    "short (1-30)": (1, 30, 200),
}


def per_sequence(q, k, v, bounds, scale, gqa):
    """The loop this replaced: one causal SDPA per sequence."""
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                *(x[s:e].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale, enable_gqa=gqa
            ).transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:])
            if e > s
        ]
    )


def _time(fn, q, k, v, bounds, scale, gqa):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    t0 = time.perf_counter()
    fn(q, k, v, bounds, scale, gqa).sum().backward()
    return (time.perf_counter() - t0) * 1e3


def main(argv=None) -> int:
    from megaopd.models.packed_attention import causal_by_length

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(0)
    print(f"torch {torch.__version__}, 1 thread, forward + backward, median of {args.reps}\n")
    print("| lengths | heads (q / kv) | tokens | per sequence ms | by length ms | speed-up |")
    print("|---|---|---|---|---|---|")
    for name, (lo, hi, n) in MIXES.items():
        bounds = [0]
        for _ in range(n):
            bounds.append(bounds[-1] + rng.randint(lo, hi))
        for hq, hk in ((4, 2), (2, 1)):
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(bounds[-1], h, 24, generator=g) for h in (hq, hk, hk))
            arms = {"loop": per_sequence, "batched": causal_by_length}
            times = {a: [] for a in arms}
            for _ in range(args.reps + 1):  # the first round warms up
                for a, fn in arms.items():
                    times[a].append(_time(fn, q, k, v, bounds, 24**-0.5, hq != hk))
            loop, batched = (statistics.median(times[a][1:]) for a in arms)
            print(
                f"| {name} | {hq} / {hk} | {bounds[-1]} | {loop:.1f} | {batched:.1f} | {loop / batched:.1f}x |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
