"""Time per training step of the tiny Stable-OPD setup, broken into its phases, at TP=1 vs TP=2.

    python benchmarks/trainer.py [--steps 6] [--models DIR]

Runs `megaopd train examples/tiny/stable_opd.yaml` for a few steps in each layout on 2 gloo workers
(TP=1 means DP=2 here, so both layouts use both cores), then reads time/* from each run's
metrics.jsonl, skipping the first step (warm-up). Uses examples/tiny/models when present, otherwise
random tiny models of the same shapes as the tests'. Prints a table with TP=2 / TP=1 ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ["time/rollout", "time/actor_logprobs", "time/teacher", "time/train", "time/sync", "time/step"]


def mean_times(run_dir: str) -> dict[str, float]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "event" not in r and r["step"] > 1 and "time/step" in r]
    return {k: sum(r[k] for r in steps) / len(steps) for k in PHASES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--models", default=os.path.join(ROOT, "examples", "tiny", "models"))
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="megaopd_bench_")
    student, teacher = os.path.join(args.models, "student"), os.path.join(args.models, "teacher")
    if not os.path.isdir(student):
        sys.path.insert(0, ROOT)
        from tests.trainer.tiny_models import make_tiny_pair

        student, teacher = make_tiny_pair(os.path.join(work, "models"))
    results = {}
    for name, layout in (
        ("TP=1 (DP=2)", ["student.tp=1", "reference.tp=1"]),
        ("TP=2", ["student.tp=2", "reference.tp=2"]),
    ):
        run = os.path.join(work, name.split()[0].replace("=", ""))
        cmd = [
            sys.executable,
            "-m",
            "megaopd.cli",
            "train",
            os.path.join(ROOT, "examples", "tiny", "stable_opd.yaml"),
            f"run.dir={run}",
            f"student.path={student}",
            f"teacher.path={teacher}",
            "teacher.tp=1",
            f"trainer.max_steps={args.steps}",
            "trainer.eval_interval=0",
            "trainer.save_interval=1000",
            # the settings benchmarks/README.md reports, pinned against later preset changes
            "trainer.prompts_per_step=16",
            "rollout.max_new_tokens=160",
            "logging.tensorboard=false",
            *layout,
        ]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results[name] = mean_times(run)
    a, b = results["TP=1 (DP=2)"], results["TP=2"]
    print(f"{'phase':<22}{'TP=1 (DP=2) s':>15}{'TP=2 s':>10}{'TP=2/TP=1':>11}")
    for k in PHASES:
        print(f"{k:<22}{a[k]:>15.3f}{b[k]:>10.3f}{b[k] / a[k] if a[k] else float('nan'):>11.2f}")


if __name__ == "__main__":
    main()
