"""Megatron model cost on CPU: forward time and memory at TP=1 vs TP=2, and checkpoint conversion time.

What is timed (models: random `tiny-qwen2` and `qwen2-100m` from megaopd.models.presets):
  forward   model(input_ids) -> vocab-sharded logits [b, s, Vp/tp], no grad, batch x seq tokens; the
            median of --reps runs after one warm-up. TP=1 is one process with one torch thread, TP=2
            two gloo processes with one thread each (so TP=2 also has twice the cores).
  memory    per rank: "weights" = RSS growth from building + loading the model; "forward peak" = peak RSS
            during the timed forwards minus RSS before them (activations, logits, buffers).
  convert   tools/convert_hf_to_megatron.py --tp N as a user runs it (wall time including process
            start-up and megatron's import), and inside the workers only the work (read safetensors,
            shard, dist_checkpointing save); plus tools/convert_megatron_to_hf.py back (wall).

    python benchmarks/models.py                        # both models, batch 4 x 256, 5 reps
    python benchmarks/models.py --models tiny-qwen2 --batch 2 --seq 128 --reps 3 --no-convert
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def forward_worker(rank, world, hf_dir, batch, seq, reps):
    import torch

    from megaopd.models.builder import BuildOptions, StageInfo, build_gpt_model
    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.hf_io import HFWeights
    from megaopd.models.weights import Placement, load_hf_weights
    from megaopd.parallel.groups import Layout, initialize_actor_layout

    pgs = initialize_actor_layout(Layout(world, 1))
    cfg = read_hf_config(hf_dir)
    rss0 = _rss_mib()
    model = build_gpt_model(cfg, Layout(tp=world), pgs, BuildOptions(init_weights=False)).eval()
    st = StageInfo.of(pgs)
    load_hf_weights(model, HFWeights(hf_dir), cfg, Placement(tp_rank=st.tp_rank, tp_size=world))
    rss_weights = _rss_mib() - rss0
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(seq).expand(batch, seq)
    times = []
    with torch.no_grad():
        model(ids, pos, attention_mask=None)  # warm-up
        rss1 = _rss_mib()
        for _ in range(reps):
            torch.distributed.barrier(group=pgs.tp)
            t0 = time.perf_counter()
            model(ids, pos, attention_mask=None)
            times.append(time.perf_counter() - t0)
    return dict(
        ms=1000 * statistics.median(times), weights_mib=rss_weights, fwd_peak_mib=max(0.0, _peak_rss_mib() - rss1)
    )


def _tool(args) -> float:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable] + args, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    return time.perf_counter() - t0


def convert_work_worker(rank, world, hf_dir, out_dir):
    """The conversion's work without process start-up: what the tool's workers do after importing."""
    import torch.distributed as dist

    from megaopd.models.convert import _hf_to_megatron_worker, hf_dtype
    from megaopd.parallel.groups import Layout

    dist.barrier()
    t0 = time.perf_counter()
    _hf_to_megatron_worker(rank, world, hf_dir, out_dir, Layout(tp=world), hf_dtype(hf_dir))
    return time.perf_counter() - t0


def _du_mib(path) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny-qwen2", "qwen2-100m"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-convert", action="store_true")
    a = ap.parse_args(argv)

    import math

    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.presets import make_hf_model
    from megaopd.models.weights import hf_shapes
    from megaopd.parallel.launch import spawn

    tmp = tempfile.mkdtemp(prefix="megaopd-bench-models-")
    fwd_rows, conv_rows = [], []
    for name in a.models:
        hf_dir = os.path.join(tmp, name)
        make_hf_model(name, hf_dir)
        n_params = sum(math.prod(s) for s in hf_shapes(read_hf_config(hf_dir)).values())
        base = None
        for tp in (1, 2):
            r = max(spawn(forward_worker, tp, (hf_dir, a.batch, a.seq, a.reps), timeout=1800), key=lambda x: x["ms"])
            base = base or r
            fwd_rows.append((name, n_params, tp, r, base))
            print(f"{name} tp={tp}: {r['ms']:.1f} ms", flush=True)
        if a.no_convert:
            continue
        for tp in (1, 2):
            ckpt, back = os.path.join(tmp, f"{name}-tp{tp}"), os.path.join(tmp, f"{name}-tp{tp}-hf")
            wall = _tool(
                [
                    os.path.join(ROOT, "tools", "convert_hf_to_megatron.py"),
                    "--hf-dir",
                    hf_dir,
                    "--out",
                    ckpt,
                    "--tp",
                    str(tp),
                ]
            )
            work = max(spawn(convert_work_worker, tp, (hf_dir, ckpt + "-work"), timeout=1800))
            back_wall = _tool([os.path.join(ROOT, "tools", "convert_megatron_to_hf.py"), "--ckpt", ckpt, "--out", back])
            conv_rows.append((name, tp, wall, work, back_wall, _du_mib(os.path.join(ckpt, "model"))))
            print(f"{name} convert tp={tp}: {wall:.1f} s", flush=True)

    load = os.getloadavg()[0]
    print(
        f"\n{os.cpu_count()}-core CPU, load average {load:.1f}, {datetime.date.today()}, "
        f"batch {a.batch} x seq {a.seq}, median of {a.reps}\n"
    )
    print(
        "| model | params | TP | forward ms | tokens/s | speed-up vs TP=1 | weights MiB/rank | ratio | "
        "forward peak MiB/rank | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, n_params, tp, r, b in fwd_rows:
        toks = a.batch * a.seq / (r["ms"] / 1000)
        print(
            f"| {name} | {n_params / 1e6:.1f}M | {tp} | {r['ms']:.1f} | {toks:.0f} | {b['ms'] / r['ms']:.2f}x | "
            f"{r['weights_mib']:.0f} | {r['weights_mib'] / max(b['weights_mib'], 1e-9):.2f} | "
            f"{r['fwd_peak_mib']:.0f} | {r['fwd_peak_mib'] / max(b['fwd_peak_mib'], 1e-9):.2f} |"
        )
    if conv_rows:
        print("\n| model | TP | HF -> Megatron wall s | of which work s | Megatron -> HF wall s | checkpoint MiB |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, tp, wall, work, back, mib in conv_rows:
            print(f"| {name} | {tp} | {wall:.1f} | {work:.1f} | {back:.1f} | {mib:.0f} |")
    return 0


if __name__ == "__main__":  # required: dist_checkpointing's writer processes re-import this module
    sys.exit(main())
