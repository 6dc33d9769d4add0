"""Command line of the GPU check: see megaopd/gpucheck/__init__.py and scripts/gpu_check.sh."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import torch

from megaopd.gpucheck.report import Table

PARTS = ("a", "b", "c", "d")
BENCHES = ("loss", "packing", "engine", "trainer")


def _environment(device: torch.device) -> str:
    import transformers

    try:
        import megatron.core

        mcore = megatron.core.__version__
    except Exception as e:  # noqa: BLE001 - reported, the parts that need it fail on their own
        mcore = f"not importable ({type(e).__name__})"
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "none (CPU)"
    return (
        f"{datetime.date.today()}, device {gpu}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"megatron-core {mcore}, transformers {transformers.__version__}, Python {platform.python_version()}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megaopd.gpucheck", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="CPU smoke mode: tiny shapes, float32, gloo (tests)")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of a,b,c,d (default all)")
    ap.add_argument(
        "--bench",
        nargs="?",
        const=",".join(BENCHES),
        default="",
        help="measurements instead of checks: comma-separated subset of loss,engine,trainer (default all)",
    )
    ap.add_argument(
        "--workdir",
        default=os.environ.get("MEGAOPD_GPU_CHECK_DIR", "/tmp/megaopd_gpu_check"),
        help="models and run folders (reused by a second call on the same machine)",
    )
    ap.add_argument("--layers", type=int, default=None, help="part b: fewer layers than the 1.5B shape's 28")
    ap.add_argument(
        "--generators",
        default="engine,hf dynamic,hf static,hf cb",
        help="bench engine: comma-separated generators to time (engine, engine compiled, hf dynamic, hf static, hf cb)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="bench engine: also profile one engine run of each case (phases and top ops)",
    )
    ap.add_argument("--dtypes", default="bfloat16,float32", help="bench engine: the engine's dtypes (GPU)")
    ap.add_argument(
        "--recompute",
        default="none,full",
        help="bench trainer: comma-separated student/reference recompute settings to run",
    )
    ap.add_argument("--peak-tflops", type=float, default=None, help="bench: the GPU's dense bf16 peak")
    a = ap.parse_args(argv)

    cuda = torch.cuda.is_available() and not a.quick
    if not cuda and not a.quick:
        print("gpu_check: no CUDA device; use --quick for the CPU smoke mode", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    os.makedirs(a.workdir, exist_ok=True)
    table = Table()
    dtypes = ["float32"] if a.quick else ["bfloat16", "float32"]
    vocab_ops = 1000 if a.quick else 152064
    t0 = time.time()
    benches = [b for b in a.bench.split(",") if b]
    parts = [] if benches else [p for p in a.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS] + [b for b in benches if b not in BENCHES]
    if bad:
        print(f"gpu_check: unknown part/bench {bad}; parts: {PARTS}, benches: {BENCHES}", file=sys.stderr)
        return 2
    for part in parts:
        t = time.time()
        print(f"[gpu_check] part {part} ...", flush=True)
        if part == "a":
            from megaopd.gpucheck import ops_check

            ops_check.check_ops(table, device, dtypes, vocab_ops, tokens=16 if a.quick else 64)
            ops_check.check_losses(table, device, dtypes, vocab_ops)
        elif part == "b":
            from megaopd.gpucheck import models_check

            with table.guard("b", "HF vs megatron"):
                if a.quick:
                    models_check.check_models(table, device, "tiny-teacher", 512, a.layers, 2, 32, dtypes)
                else:
                    models_check.check_models(table, device, "qwen2.5-1.5b", 151936, a.layers, 4, 512, dtypes)
        elif part == "c":
            from megaopd.gpucheck import trainer_check

            setup = trainer_check.quick_setup() if a.quick else trainer_check.gpu_setup()
            trainer_check.check_trainer(table, setup, a.workdir, device.type)
        elif part == "d":
            from megaopd.gpucheck import tp_check

            tp_check.check_tp2(table, device, dtypes, vocab_ops, tokens=16 if a.quick else 64)
        print(f"[gpu_check] part {part}: {time.time() - t:.0f} s", flush=True)
    from megaopd.gpucheck.build import QWEN_VOCAB as QWEN_VOCAB_BENCH

    for b in benches:
        t = time.time()
        print(f"[gpu_check] bench {b} ...", flush=True)
        from megaopd.gpucheck import bench

        if b == "loss":
            bench.bench_loss(
                table,
                device,
                vocab_ops,
                (256, 512) if a.quick else (4096, 8192),
                torch.float32 if a.quick else torch.bfloat16,
            )
        elif b == "packing":
            if a.quick:
                bench.bench_packing(
                    table,
                    device,
                    "tiny-student",
                    512,
                    sequences=8,
                    scale=1 / 64,
                    micro_batch_size=2,
                    dtype=torch.float32,
                    reps=1,
                )
            else:
                bench.bench_packing(table, device, "qwen2.5-0.5b", QWEN_VOCAB_BENCH, sequences=16)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the bench's model died with its frame: hand its memory back
        elif b == "engine":
            from megaopd.gpucheck.build import QWEN_VOCAB, write_hf_dir

            shape, vocab = ("tiny-student", 512) if a.quick else ("qwen2.5-1.5b", QWEN_VOCAB)
            hf_dir = write_hf_dir(
                os.path.join(a.workdir, f"bench_{shape}"),
                shape,
                vocab,
                device.type,
                torch.float32 if a.quick else torch.bfloat16,
                4,
            )
            bench.bench_engine(
                table,
                hf_dir,
                ["float32"] if a.quick else a.dtypes.split(","),
                slots=4 if a.quick else 64,
                new_tokens=16 if a.quick else 128,
                repeats=1 if a.quick else 3,
                generators=a.generators.split(","),
                profile=a.profile,
            )
        elif b == "trainer":
            if a.quick:
                table.skip("bench", "trainer", "GPU only (1.5B shape)")
            else:
                # The same run with and without activation recomputation, the engine colocated in both (its
                # float32 weights leave the GPU while the actor trains). Without full recomputation the
                # 16384-token budget does not fit 80 GB (an 80 GB H100 runs out of memory there, and
                # `megaopd plan` says so); half of it does.
                for recompute in a.recompute.split(","):
                    budget = [] if recompute == "full" else ["trainer.max_tokens_per_micro_batch=8192"]
                    bench.bench_trainer(
                        table,
                        a.workdir,
                        device.type,
                        peak_tflops=a.peak_tflops,
                        overrides=[
                            f"student.recompute={recompute}",
                            f"reference.recompute={recompute}",
                            "rollout.colocated=true",
                            *budget,
                        ],
                        label=f"recompute={recompute}" + (" 8k tokens" if budget else ""),
                    )
        print(f"[gpu_check] bench {b}: {time.time() - t:.0f} s", flush=True)
    title = ("megaopd GPU check" if parts else "megaopd GPU measurements") + (" (--quick, CPU)" if a.quick else "")
    text = f"# {title}\n\n{_environment(device)}; {time.time() - t0:.0f} s\n\n" + table.markdown()
    print(text, flush=True)
    name = "gpu_check.md" if parts else "gpu_bench.md"
    path = table.write(text, name)
    if path:
        print(f"[gpu_check] table written to {path}")
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
