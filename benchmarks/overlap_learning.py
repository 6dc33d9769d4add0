"""Is learning lost when rollouts lag? The tiny Stable-OPD run (examples/tiny/stable_opd.yaml: 40 steps of
32 prompts x 4, lr 5e-4, validation on all 200 problems at steps 0 and 40) with its rollouts from one
`megaopd serve` engine, in rollout.mode sync and one_step_off under each off-policy correction, 3 seeds
each; then async at max_staleness 2 and 4 under each correction (--async-seeds, default the first seed).
Every run is one trainer process and one server process, one thread each.

    python benchmarks/overlap_learning.py [--out runs/overlap_learning] [--seeds 1 2 3] [--async-seeds 1 2 3]
                                          [--parallel 2] [--arms sync one_step_off_tis]
    python benchmarks/overlap_learning.py --report-only

Prints a markdown table: final validation accuracy (mean +/- standard error over seeds, and per seed),
truncation and repetition rates (rollouts, mean of the last five steps), the reverse-KL term
(`opd/reverse_kl`, mean of the last five steps), the mean staleness, and the off-policy weights (tis / mis).
A run whose summary.json exists is not run again. `recompute` is left out of the grid: with the preset's one
mini-batch per step the recomputed reward equals log pi_old's (docs/algorithms.md 1.12), so its runs repeat
`none`'s. Results: benchmarks/README.md, "Learning is not lost".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overlap import ROOT, TINY, _serve  # noqa: E402  (the same served engine as the step-time benchmark)

CORRECTIONS = ("none", "tis", "mis")


def arms(seeds: list[int], async_seeds: list[int] | None = None) -> list[tuple[str, str, int, int]]:
    """(mode, correction, max_staleness, seed): sync and one_step_off seed-major (a study cut short has whole
    seeds), then async (for async_seeds, default the first seed)."""
    grid = [g for s in seeds for g in [("sync", "none", 1, s)] + [("one_step_off", c, 1, s) for c in CORRECTIONS]]
    return grid + [("async", c, n, s) for s in (async_seeds or seeds[:1]) for n in (2, 4) for c in CORRECTIONS]


def name(mode: str, correction: str, staleness: int) -> str:
    return mode if mode == "sync" else f"{mode}_{correction}" + (f"_s{staleness}" if mode == "async" else "")


def run_dir(out: str, arm: tuple) -> str:
    return os.path.join(out, name(*arm[:3]), f"seed_{arm[3]}")


def start(out: str, arm: tuple, env: dict, steps: int) -> tuple[subprocess.Popen, subprocess.Popen]:
    mode, correction, staleness, seed = arm
    server, url = _serve(env, 64)
    d = run_dir(out, arm)
    os.makedirs(d, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "megaopd.cli",
        "train",
        os.path.join(TINY, "stable_opd.yaml"),
        f"run.dir={d}",
        "run.world_size=1",
        "student.tp=1",
        "reference.tp=1",
        "teacher.tp=1",
        f"trainer.max_steps={steps}",
        f"trainer.eval_interval={steps}",
        f"trainer.save_interval={steps}",
        "logging.tensorboard=false",
        "logging.progress_bar=off",
        "rollout.engine=remote",
        f"rollout.urls=[{url}]",
        f"rollout.mode={mode}",
        f"loss.off_policy_correction={correction}",
        f"trainer.seed={seed}",
        f"data.seed={seed}",
    ]
    if mode == "async":
        cmd.append(f"rollout.max_staleness={staleness}")
    log = open(os.path.join(d, "train.log"), "a")
    return server, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_all(out: str, todo: list[tuple], parallel: int, steps: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MEGAOPD_WORKER_THREADS="1", PYTHONPATH=ROOT)
    todo = [a for a in todo if not os.path.exists(os.path.join(run_dir(out, a), "summary.json"))]
    running = []
    while todo or running:
        while todo and len(running) < parallel:
            arm = todo.pop(0)
            print(f"start {name(*arm[:3])} seed {arm[3]}", flush=True)
            running.append((arm, *start(out, arm, env, steps), time.time()))
        time.sleep(2)
        for item in list(running):
            arm, server, proc, t0 = item
            if proc.poll() is not None:
                server.kill()
                server.wait()
                running.remove(item)
                status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}; see its train.log)"
                print(f"{status}: {name(*arm[:3])} seed {arm[3]} in {time.time() - t0:.0f} s", flush=True)


def stats(path: str) -> dict | None:
    if not os.path.exists(os.path.join(path, "summary.json")):
        return None
    rows = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    steps = [r for r in rows if "event" not in r]
    val = [r["val/accuracy"] for r in steps if "val/accuracy" in r]
    last = [r for r in steps if "loss/total" in r][-5:]

    def tail(key):
        return statistics.mean(r.get(key, 0.0) for r in last)

    return {
        "start": val[0],
        "final": val[-1],
        "trunc": tail("rollout/truncation_rate"),
        "rep": tail("rollout/repetition_rate"),
        "rkl": tail("opd/reverse_kl"),
        "stale": tail("pipeline/staleness_mean"),
        "w_mean": tail("off_policy/weight_mean"),
        "clip": tail("off_policy/clip_frac"),
    }


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = statistics.mean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


def report(out: str, seeds: list[int], async_seeds: list[int] | None = None) -> str:
    groups: dict[str, list[dict]] = {}
    for arm in arms(seeds, async_seeds):
        s = stats(run_dir(out, arm))
        if s is not None:
            groups.setdefault(name(*arm[:3]), []).append(s)
    lines = [
        "| arm | seeds | final val accuracy | per seed | truncation | repetition | reverse KL | staleness "
        "| weight mean / clipped (tis, mis) |",
        "|---|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for arm, ss in groups.items():
        m, se = mean_se([s["final"] for s in ss])
        avg = {k: statistics.mean(s[k] for s in ss) for k in ss[0]}
        w = f"{avg['w_mean']:.3f} / {avg['clip']:.4f}" if "tis" in arm or "mis" in arm else "-"
        per_seed = ", ".join(f"{s['final']:.3f}" for s in ss)
        lines.append(
            f"| {arm} | {len(ss)} | {m:.3f} +/- {se:.3f} | {per_seed} | "
            f"{avg['trunc']:.3f} | {avg['rep']:.3f} | {avg['rkl']:.4f} | {avg['stale']:.2f} | {w} |"
        )
    if "sync" in groups:
        start_acc = groups["sync"][0]["start"]
        finals = [s["final"] for s in groups["sync"]]
        lines += [
            "",
            f"Validation accuracy at step 0: {start_acc}. sync's seeds span {min(finals):.3f}-{max(finals):.3f}.",
        ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/overlap_learning")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--parallel", type=int, default=2, help="runs at a time (each: a trainer and a server)")
    ap.add_argument(
        "--async-seeds",
        type=int,
        nargs="+",
        default=None,
        help="seeds of the async arms (default: the first of --seeds)",
    )
    ap.add_argument(
        "--arms",
        nargs="+",
        default=None,
        help="run only these arms (names as in the table: sync, one_step_off_tis, async_tis_s2, ...)",
    )
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--steps", type=int, default=40, help="trainer.max_steps (40: the preset's run)")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    if not args.report_only:
        todo = [a for a in arms(args.seeds, args.async_seeds) if args.arms is None or name(*a[:3]) in args.arms]
        run_all(out, todo, args.parallel, args.steps)
    table = report(out, args.seeds, args.async_seeds)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
