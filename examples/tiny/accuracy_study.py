"""The accuracy study on the tiny CPU setup: plain OPD vs Stable-OPD (fixed weights) vs Stable-OPD with the
adaptive controller (loss.controller=adaptive), 3 seeds each, every run on one thread (about 2-4 minutes on
a quiet 2-core EPYC; up to 20 under heavy load); then the table
(final validation accuracy mean +/- standard error over seeds, the step where the rollouts' truncation rate
first passes 0.2, golden tokens used, the weights over the run) and the figures (`megaopd plot --bands`:
accuracy, truncation and repetition per step with the seed band).

    python examples/tiny/accuracy_study.py [--out runs/tiny/accuracy_study] [--seeds 1 2 3] [--parallel 1]
    python examples/tiny/accuracy_study.py --report-only      # the table and figures of what has run
    python examples/tiny/accuracy_study.py --regime stress --seeds 1   # the controller under collapse.sh's stress
    python examples/tiny/accuracy_study.py --arms cross_tokenizer opd --max-steps 20 --set optimizer.lr=5.0e-4
                                        # the cross-tokenizer teacher study (examples/tiny/README.md)

A run whose summary.json exists is not run again (an interrupted run resumes from its last checkpoint), so
the study can be stopped and started again; --report-only tabulates the seeds that finished. The regime
(REGIME below) and why it was chosen: examples/tiny/README.md, "The accuracy study". Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One process, one thread: the student, reference and teacher at TP=1 in a single rank.
ONE_THREAD = ["run.world_size=1", "student.tp=1", "reference.tp=1", "teacher.tp=1"]
# The regime: the demo's settings (32 prompts x 4, 128 tokens, clip 1.0) at 6x its learning rate (README).
REGIME = ["optimizer.lr=3.0e-3", "trainer.max_steps=40", "trainer.eval_interval=10", "trainer.save_interval=20"]
# Stable-OPD's anchors, and the adaptive controller's bounds: from 0 up to the fixed arm's weights.
FIXED = ["loss.config.sft_weight=1.0", "loss.config.ref_kl_weight=0.2"]
ADAPTIVE = [
    "loss.controller=adaptive",
    "loss.config.sft_weight=0.0",
    "loss.config.ref_kl_weight=0.0",
    "loss.adaptive.sft_weight_max=1.0",
    "loss.adaptive.ref_kl_weight_max=0.2",
]
# --regime stress: collapse.sh's setting (lr 5e-3, no clipping, 384 tokens, 16 prompts x 4, 180 steps), where
# plain OPD's rollouts collapse into loops; the preset's weights and the controller's default bounds.
STRESS = [
    "optimizer.lr=5.0e-3",
    "optimizer.clip_grad=0",
    "trainer.prompts_per_step=16",
    "rollout.max_new_tokens=384",
    "validation.max_new_tokens=384",
    "trainer.max_steps=180",
    "trainer.eval_interval=20",
    "trainer.save_interval=60",
    "validation.max_problems=32",
]
REGIMES = {  # name -> (settings, {arm: (preset, overrides)})
    "accuracy": (
        REGIME,
        {
            "opd": ("examples/tiny/opd.yaml", []),
            "stable_opd_fixed": ("examples/tiny/stable_opd.yaml", FIXED),
            "stable_opd_adaptive": ("examples/tiny/stable_opd.yaml", ADAPTIVE),
            # privileged-context self-distillation: plain OPD whose teacher is the starting student shown the
            # golden solution (examples/tiny/self_distill.yaml; ONE_THREAD puts its teacher at TP=1)
            "self_distill": ("examples/tiny/self_distill.yaml", []),
            # the same with only the final answer after the problem, not the whole golden solution
            "self_distill_answer": (
                "examples/tiny/self_distill.yaml",
                ['teacher.context="{problem}\\n{instruction}\\nThe answer is {answer}."'],
            ),
            # plain OPD from the teacher of another vocabulary (examples/tiny/cross_tokenizer.yaml: teacher_xtok,
            # teacher.tokenizer=own, span-summed advantages); ONE_THREAD puts it at the student's TP=1
            "cross_tokenizer": ("examples/tiny/cross_tokenizer.yaml", []),
        },
    ),
    "stress": (
        STRESS,
        {
            "opd": ("examples/tiny/opd.yaml", []),
            "stable_opd_fixed": ("examples/tiny/stable_opd.yaml", []),
            "stable_opd_adaptive": (
                "examples/tiny/stable_opd.yaml",
                ["loss.controller=adaptive", "loss.config.sft_weight=0.0", "loss.config.ref_kl_weight=0.0"],
            ),
        },
    ),
}
SETTINGS, ARMS = REGIMES["accuracy"]


def run_dir(out: str, arm: str, seed: int) -> str:
    return os.path.join(out, arm, f"seed_{seed}")


def command(out: str, arm: str, seed: int, max_steps: int | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    preset, overrides = ARMS[arm]
    shorter = [f"trainer.max_steps={max_steps}"] if max_steps else []  # a study cut to fit a budget
    return [
        sys.executable,
        "-m",
        "megaopd.cli",
        "train",
        preset,
        f"run.dir={run_dir(out, arm, seed)}",
        *ONE_THREAD,
        *SETTINGS,
        *overrides,
        *shorter,
        *extra,
        f"trainer.seed={seed}",
        f"data.seed={seed}",
    ]


def run_all(
    out: str,
    seeds: list[int],
    parallel: int,
    nice: int,
    arms: list[str],
    max_steps: int | None = None,
    extra: tuple[str, ...] = (),
) -> None:
    """Seed-major order (every arm of seed 1, then seed 2, ...), so a study cut short has whole seeds."""
    jobs = [
        (
            f"{arm} seed {s}",
            (["nice", "-n", str(nice)] if nice else []) + command(out, arm, s, max_steps, extra),
            run_dir(out, arm, s),
        )
        for s in seeds
        for arm in arms
        if not os.path.exists(os.path.join(run_dir(out, arm, s), "summary.json"))
    ]
    run_jobs(jobs, parallel)


def run_jobs(jobs: list[tuple[str, list[str], str]], parallel: int) -> None:
    """Runs (name, command, run folder) jobs from the repository root, `parallel` at a time, each on one thread
    with its output in RUN/train.log; says when each starts and ends."""
    env = dict(os.environ, MEGAOPD_WORKER_THREADS="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    todo = list(jobs)
    running: list[tuple[subprocess.Popen, str, float]] = []
    while todo or running:
        while todo and len(running) < parallel:
            name, cmd, folder = todo.pop(0)
            os.makedirs(folder, exist_ok=True)
            log = open(os.path.join(folder, "train.log"), "a")
            print(f"start {name}: {' '.join(cmd[-12:])}", flush=True)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((proc, name, time.time()))
        time.sleep(2)
        for item in list(running):
            proc, name, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}; see its train.log)"
                print(f"{status}: {name} in {time.time() - t0:.0f} s", flush=True)


def read_rows(path: str) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if "event" not in obj:
                rows[int(obj["step"])] = obj
    return rows


def run_stats(path: str, arm: str) -> dict | None:
    """One finished run's numbers, or None when it has not finished."""
    if not os.path.exists(os.path.join(path, "summary.json")):
        return None
    rows = read_rows(os.path.join(path, "metrics.jsonl"))
    val = [(s, r["val/accuracy"]) for s, r in sorted(rows.items()) if "val/accuracy" in r]
    trunc = [s for s, r in sorted(rows.items()) if r.get("rollout/truncation_rate", 0.0) > 0.2]
    train = [r for s, r in rows.items() if "loss/total" in r]
    overrides = {"loss.config.sft_weight": 0.1, "loss.config.ref_kl_weight": 0.01}  # the preset's
    overrides.update(o.split("=", 1) for o in ARMS[arm][1])

    def weight(key: str) -> float:  # mean over the run's steps: logged (adaptive) or configured (fixed)
        if any(f"controller/{key}" in r for r in train):
            return sum(r.get(f"controller/{key}", 0.0) for r in train) / len(train)
        return float(overrides.get(f"loss.config.{key}", 0.0)) if "stable_opd" in ARMS[arm][0] else 0.0

    return {
        "final": val[-1][1],
        "start": val[0][1],
        "first_trunc": trunc[0] if trunc else None,
        "golden": sum(r.get("sft/num_tokens", 0.0) for r in train if "loss/sft" in r),
        "sft_weight": weight("sft_weight"),
        "ref_kl_weight": weight("ref_kl_weight"),
        "events": sum(1 for line in open(os.path.join(path, "metrics.jsonl")) if '"loss_controller"' in line),
        # the sampled-token reverse KL(student || teacher) per student token (opd's metric; a cross-tokenizer
        # teacher's is the span log-ratios spread over the span's tokens: the same sequence-level quantity)
        "rkl": [r["opd/reverse_kl"] for s, r in sorted(rows.items()) if "opd/reverse_kl" in r],
    }


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def rkl_text(runs: list[dict]) -> str:
    """The mean over seeds of the first and the last step's reverse KL; blank for losses that log none."""
    with_kl = [v["rkl"] for v in runs if v["rkl"]]
    if not with_kl:
        return ""
    return f"{sum(k[0] for k in with_kl) / len(with_kl):.3f} -> {sum(k[-1] for k in with_kl) / len(with_kl):.3f}"


def report(out: str, seeds: list[int]) -> str:
    stats = {arm: {s: run_stats(run_dir(out, arm, s), arm) for s in seeds} for arm in ARMS}
    lines = [
        "| arm | seeds | final val accuracy (mean +/- SE) | per seed | truncation first > 0.2 | "
        "golden tokens used (mean) | sft_weight / ref_kl_weight (mean over steps) | controller events | "
        "reverse KL to the teacher per token, first step -> last (mean) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    finals = {}
    for arm, per_seed in stats.items():
        done = {s: v for s, v in per_seed.items() if v is not None}
        if not done:
            lines.append(f"| {arm} | 0 | not run | | | | | | |")
            continue
        finals[arm] = [v["final"] for v in done.values()]
        m, se = mean_se(finals[arm])
        first = ", ".join("never" if v["first_trunc"] is None else str(v["first_trunc"]) for v in done.values())
        golden = sum(v["golden"] for v in done.values()) / len(done)
        w = (
            sum(v["sft_weight"] for v in done.values()) / len(done),
            sum(v["ref_kl_weight"] for v in done.values()) / len(done),
        )
        lines.append(
            f"| {arm} | {','.join(map(str, done))} | {m:.3f} +/- {se:.3f} | "
            f"{', '.join(f'{x:.3f}' for x in finals[arm])} | {first} | {golden:,.0f} | {w[0]:.3g} / {w[1]:.3g} | "
            f"{sum(v['events'] for v in done.values())} | {rkl_text(list(done.values()))} |"
        )
    start = next((v["start"] for per in stats.values() for v in per.values() if v), None)
    lines.append("")
    lines.append(f"- Validation accuracy at step 0 (all runs): {start}.")
    for arm in (a for a in ARMS if a != "opd"):
        if arm in finals and "opd" in finals and len(finals[arm]) > 1 and len(finals["opd"]) > 1:
            (m1, se1), (m0, se0) = mean_se(finals[arm]), mean_se(finals["opd"])
            se = math.sqrt(se1**2 + se0**2)
            verdict = "NOT more than 2 standard errors"  # either way: an arm below opd is not "more"
            if abs(m1 - m0) > 2 * se:
                verdict = f"more than 2 standard errors {'above' if m1 > m0 else 'BELOW'} opd"
            lines.append(
                f"- {arm} - opd: {m1 - m0:+.3f}, standard error of the difference {se:.3f} "
                f"({(m1 - m0) / se:.1f} SE): {verdict}."
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="default: runs/tiny/accuracy_study[_stress]")
    ap.add_argument("--regime", choices=sorted(REGIMES), default="accuracy")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time (each is one process, one thread)")
    ap.add_argument("--nice", type=int, default=5, help="niceness of the runs (0: none)")
    ap.add_argument("--arms", nargs="+", default=None, help="run only these arms (default: all)")
    ap.add_argument("--max-steps", type=int, default=None, help="fewer steps than the regime's (said in the table)")
    ap.add_argument("--set", nargs="+", default=[], help="key=value overrides of every run (e.g. optimizer.lr=5e-4)")
    ap.add_argument("--report-only", action="store_true", help="tabulate and plot what has finished")
    args = ap.parse_args(argv)
    global SETTINGS, ARMS
    SETTINGS, ARMS = REGIMES[args.regime]
    out = os.path.abspath(args.out or "runs/tiny/accuracy_study" + ("" if args.regime == "accuracy" else "_stress"))
    if not args.report_only:
        run_all(out, args.seeds, args.parallel, args.nice, args.arms or list(ARMS), args.max_steps, tuple(args.set))
    table = report(out, args.seeds)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    finished = [
        run_dir(out, a, s)
        for a in ARMS
        for s in args.seeds
        if os.path.exists(os.path.join(run_dir(out, a, s), "summary.json"))
    ]
    if finished:
        subprocess.run(
            [sys.executable, "-m", "megaopd.cli", "plot", *finished, "--bands", "--out", os.path.join(out, "plots")],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT),
            check=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
