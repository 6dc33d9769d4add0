"""The LoRA study of issue 55 on the tiny CPU setup: LoRA at two ranks against full Stable-OPD, several seeds each,
the same steps; a markdown table on stdout (examples/tiny/README.md, "A LoRA student: the study").

    PYTHONPATH=. python benchmarks/lora_study.py --out /tmp/lora_study [--seeds 1234,1235,1236] [--steps 40]
                                                 [--parallel 1] [--arms full,r8,r32]

Arms (every one examples/tiny's 40-step Stable-OPD, student TP=2 on 2 gloo workers, validation on all 200 problems):
    full   examples/tiny/stable_opd.yaml as shipped (lr 5e-4: every student weight trains)
    r8     examples/tiny/lora_opd.yaml at rank 8, alpha 32, lr 5e-3 (adapters on every linear, base frozen)
    r32    the same at rank 32
    ARM@LR any of them at another learning rate (the lr probe: r8@2e-3, r8@1.5e-2)
alpha stays 32 at both ranks, as "LoRA Without Regret" does (its 1/r scaling makes the best lr nearly independent
of the rank), so the two LoRA arms share one lr, 10x full's; the @LR arms probe others (4x did better on the
tiny setup: examples/tiny/README.md, "The study").

Per run (a `megaopd train` process, its folder OUT/ARM_sSEED; a finished run's OUT/ARM_sSEED.json is reused, so a
rerun only runs what is missing, and --collect runs nothing):
    val/accuracy at the last step; opd/reverse_kl at the last step (the rollout batch's, so it moves with sampling)
        and its mean over the last 10 steps;
    peak RSS: the largest rank process's VmHWM over the whole run (benchmarks/plan_vs_measured.measure), in GB;
    optimizer state: the bytes of the final checkpoint's optimizer shards (optimizer/*.distcp, both TP ranks);
    time/sync: the median over the run's steps of the trainer's sync time (push into the embedded engine and
        the parity probe).
Bytes per weight sync do not depend on the run: they are measured once per arm in one process (TP=1, float32,
megaopd.sync.WeightSync into an embedded engine, the steady push after the first; LoRA with rollout.lora_sync
adapter: the adapters alone) with the push's own seconds (median of 5).
Mean +- spread: the mean over seeds and half the range (max - min) / 2.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STUDENT = os.path.join(ROOT, "examples", "tiny", "models", "student")


def arm_spec(arm: str) -> tuple[str, tuple[str, ...], int | None]:
    """(config, overrides, LoRA rank or None) of an arm: full, rN (rank N, alpha 32), either with @LR (another
    learning rate: r8@2e-3)."""
    name, _, lr = arm.partition("@")
    extra = (f"optimizer.lr={float(lr)}",) if lr else ()
    if name == "full":
        return "examples/tiny/stable_opd.yaml", extra, None
    if name.startswith("r") and name[1:].isdigit():
        r = int(name[1:])
        return "examples/tiny/lora_opd.yaml", (f"student.lora.rank={r}", "student.lora.alpha=32", *extra), r
    raise SystemExit(f"--arms: {arm!r} is not full or rN (e.g. r8), with an optional @LR (r8@2e-3)")


def _lr(arm: str) -> float:
    from megaopd.config import load_config
    from megaopd.config.schema import MegaOPDConfig

    config, overrides, _ = arm_spec(arm)
    return load_config(MegaOPDConfig, os.path.join(ROOT, config), list(overrides)).optimizer.lr


def run_one(arm: str, seed: int, steps: int, out: str) -> dict:
    """One `megaopd train` run of the arm at the seed; its record (also written to OUT/ARM_sSEED.json)."""
    from benchmarks.plan_vs_measured import measure

    path = os.path.join(out, f"{arm}_s{seed}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    config, overrides, _ = arm_spec(arm)
    run_dir = os.path.join(out, f"{arm}_s{seed}")
    overrides = [
        *overrides,
        f"trainer.seed={seed}",
        f"trainer.max_steps={steps}",
        f"trainer.save_interval={steps}",
        f"trainer.eval_interval={steps}",
        "logging.progress_bar=off",
        "logging.tensorboard=false",
    ]
    m = measure(os.path.join(ROOT, config), overrides, run_dir, world=2, timeout=7200)
    if m["rc"] != 0:
        raise RuntimeError(f"{arm} seed {seed}: megaopd train exited {m['rc']}:\n{m['log']}")
    rows = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps_rows = [r for r in rows if "opd/reverse_kl" in r]
    val = [r for r in rows if "val/accuracy" in r]
    ckpt = os.path.join(run_dir, "checkpoints", f"step_{steps:06d}", "optimizer")
    rec = {
        "arm": arm,
        "seed": seed,
        "steps": steps,
        "val_start": val[0]["val/accuracy"],
        "val_end": val[-1]["val/accuracy"],
        "rkl_end": steps_rows[-1]["opd/reverse_kl"],
        "rkl_last10": statistics.mean(r["opd/reverse_kl"] for r in steps_rows[-10:]),
        "peak_rss_gb": max(m["peaks_gb"]),
        "optim_bytes": sum(os.path.getsize(p) for p in glob.glob(os.path.join(ckpt, "*.distcp"))),
        "sync_s": statistics.median(r["time/sync"] for r in steps_rows),
        "step_s": statistics.median(r["time/step"] for r in steps_rows),
        "wall_s": m["seconds"],
    }
    with open(path, "w") as f:
        json.dump(rec, f)
    print(json.dumps(rec), flush=True)
    return rec


def _sync_worker(rank, world, hf_dir, arms, repeats):
    """Bytes and seconds of a steady push per arm (TP=1, one process): rollout.lora_sync=adapter for LoRA arms."""
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.models.config import LoRAConfig, StudentConfig
    from megaopd.models.lora import adapter_parameters
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.rollout.config import RolloutConfig
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.sync import WeightSync
    from megaopd.trainer.roles import load_role_model

    pgs = initialize_actor_layout(Layout(1))
    out = {}
    for arm, rank_ in arms:
        lora = LoRAConfig(enabled=rank_ is not None, rank=rank_ or 16, alpha=32.0)
        actor = load_role_model(StudentConfig(path=hf_dir, lora=lora), pgs, trainable=True, seed=1)
        for p in adapter_parameters(actor.model):
            p.data.normal_(0.0, 0.02)
        engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=hf_dir, max_batch_size=4, load_tokenizer=False))
        sync = WeightSync(engine, RolloutConfig(lora_sync="adapter" if rank_ else "auto"), rank)
        pushes = [sync.push(actor.model, actor.hf, pgs, weight_version=str(v)) for v in range(repeats + 1)]
        sync.close()
        trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
        out[arm] = {
            "sync_bytes": pushes[1].bytes,
            "sync_tensors": pushes[1].tensors,
            "push_s": statistics.median(p.seconds for p in pushes[1:]),
            "trainable": trainable,
        }
    return out


def _ms(xs, fmt):
    xs = list(xs)
    return f"{fmt(statistics.mean(xs))} ± {fmt((max(xs) - min(xs)) / 2)}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder of the runs and their records")
    p.add_argument("--arms", default="full,r8,r32")
    p.add_argument("--seeds", default="1234,1235,1236")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--parallel", type=int, default=1, help="runs at a time")
    p.add_argument("--collect", action="store_true", help="run nothing: tabulate the finished records")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    arms = a.arms.split(",")
    seeds = [int(s) for s in a.seeds.split(",")]
    jobs = [(arm, s) for s in seeds for arm in arms]
    if a.collect:
        recs = []
        for arm, s in jobs:
            path = os.path.join(a.out, f"{arm}_s{s}.json")
            if os.path.exists(path):
                with open(path) as f:
                    recs.append(json.load(f))
    else:
        with ThreadPoolExecutor(a.parallel) as pool:
            recs = list(pool.map(lambda j: run_one(j[0], j[1], a.steps, a.out), jobs))
    from megaopd.parallel.launch import spawn

    sync = spawn(_sync_worker, 1, args=(STUDENT, [(arm, arm_spec(arm)[2]) for arm in arms], 5), timeout=1800)[0]
    print(
        "\n| arm | lr | seeds | val accuracy (step 0 -> last) | opd/reverse_kl last step | last 10 steps | "
        "peak RSS GB (largest rank) | trained params | optimizer state bytes (checkpoint) | bytes per sync | "
        "push s | time/sync s (in run) |"
    )
    print("|---|---:|---:|---|---|---|---|---:|---:|---:|---:|---|")
    for arm in arms:
        rs = [r for r in recs if r["arm"] == arm]
        if not rs:
            continue
        sy = sync[arm]
        print(
            f"| {arm} | {_lr(arm):g} | {len(rs)} | {statistics.mean(r['val_start'] for r in rs):.3f} -> "
            f"{_ms((r['val_end'] for r in rs), lambda x: f'{x:.3f}')} | "
            f"{_ms((r['rkl_end'] for r in rs), lambda x: f'{x:.3f}')} | "
            f"{_ms((r['rkl_last10'] for r in rs), lambda x: f'{x:.3f}')} | "
            f"{_ms((r['peak_rss_gb'] for r in rs), lambda x: f'{x:.2f}')} | {sy['trainable']:,} | "
            f"{statistics.mean(r['optim_bytes'] for r in rs):,.0f} | {sy['sync_bytes']:,} | {sy['push_s']:.4f} | "
            f"{_ms((r['sync_s'] for r in rs), lambda x: f'{x:.3f}')} |"
        )
    print("\nper run: " + "; ".join(f"{r['arm']} s{r['seed']} {r['val_end']:.3f}" for r in recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
