"""Served-teacher scoring while the batch generates (rollout.stream_parts) vs after it, on this machine: one
`megaopd serve` engine (the tiny student) and one `megaopd serve` teacher (the tiny teacher), one torch
thread each, beside a one-process trainer (one thread), the tiny Stable-OPD preset in rollout.mode=sync, the
same seeds in every variant.

    python benchmarks/streaming.py [--steps 6] [--parts 1 4] [--rounds 2] [--prompts 32] [--teacher in_job]

--teacher in_job: the tiny teacher inside the trainer instead: the actor's and the teacher's in-job passes
score each part as it returns (megaopd.trainer.rollout_stage), so "actor pass s" and "teacher wait s" are what is
left after the rollout, and the rollout's time includes the passes that ran meanwhile.

Per variant (fresh servers and run folder), means over the steps after the first:
  s/step                time/step
  rollout s             generation (time/rollout)
  teacher wait s        what the step waited for the teacher after the actor's pass (time/teacher)
  teacher thread s      the served scoring left after generation (time/teacher_remote)
  streamed              rows scored while the batch generated (pipeline/teacher_streamed_fraction)
Rounds repeat the variants in turn (a change of machine load hits all of them); read the ratios.
Results: benchmarks/README.md "Streaming teacher scores".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overlap import ROOT, TINY, _serve  # noqa: E402


def run(parts: int, args, env) -> dict:
    served = args.teacher == "served"
    engine, engine_url = _serve(env, 64)
    teacher, teacher_url = _serve(env, 64, model="teacher") if served else (None, None)
    run_dir = tempfile.mkdtemp(prefix=f"streaming_{parts}_")
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "megaopd.cli",
                "train",
                os.path.join(TINY, "stable_opd.yaml"),
                f"run.dir={run_dir}",
                "run.world_size=1",
                "student.tp=1",
                "reference.tp=1",
                "teacher.tp=1",
                f"trainer.max_steps={args.steps}",
                f"trainer.prompts_per_step={args.prompts}",
                "trainer.save_interval=100000",
                "trainer.eval_interval=0",
                "validation.path=''",
                "logging.tensorboard=false",
                "logging.progress_bar=off",
                "rollout.engine=remote",
                f"rollout.urls=[{engine_url}]",
                f"rollout.stream_parts={parts}",
            ]
            + (["teacher.engine=remote", f"teacher.urls=[{teacher_url}]"] if served else []),
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [r for r in map(json.loads, f) if "event" not in r and r["step"] > 1]
    finally:
        for proc in (engine, teacher) if served else (engine,):
            proc.kill()
            proc.wait()

    def mean(key):
        vals = [r[key] for r in rows if key in r]
        return statistics.mean(vals) if vals else 0.0

    return {
        "step": mean("time/step"),
        "rollout": mean("time/rollout"),
        "teacher": mean("time/teacher"),
        "remote": mean("time/teacher_remote"),
        "actor": mean("time/actor_logprobs"),
        "streamed": mean("pipeline/teacher_streamed_fraction" if served else "pipeline/streamed_parts"),
        "loss": mean("loss/total"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--parts", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument(
        "--teacher",
        choices=("served", "in_job"),
        default="served",
        help="in_job: the teacher in the trainer, so the actor's and its passes stream (sync mode)",
    )
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MEGAOPD_WORKER_THREADS="1", PYTHONPATH=ROOT)
    results: dict[int, list[dict]] = {p: [] for p in args.parts}
    for _ in range(args.rounds):
        for p in args.parts:
            results[p].append(run(p, args, env))
    base = statistics.mean(r["step"] for r in results[args.parts[0]])
    streamed = "streamed fraction" if args.teacher == "served" else "parts streamed"
    print(
        f"| stream_parts | s/step | vs {args.parts[0]} | rollout s | actor pass s | teacher wait s | teacher thread s "
        f"| {streamed} | loss (same in each) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p, rs in results.items():
        m = {k: statistics.mean(r[k] for r in rs) for k in rs[0]}
        print(
            f"| {p} | {m['step']:.2f} | {m['step'] / base:.2f} | {m['rollout']:.2f} | {m['actor']:.2f} | "
            f"{m['teacher']:.2f} | {m['remote']:.2f} | {m['streamed']:.2f} | {m['loss']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
