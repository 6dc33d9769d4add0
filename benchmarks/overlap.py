"""Step time of rollout.mode sync / one_step_off / async on this machine: one `megaopd serve` engine (one
torch thread) beside a one-process trainer (one thread), the tiny Stable-OPD preset, same seeds.

    python benchmarks/overlap.py [--steps 8] [--prompts 8] [--max-new-tokens 48] [--rounds 1]

Each mode gets a fresh server (a served engine keeps the weight-update group of the trainer that made it)
and a fresh run folder; the table's times are means over the steps after the first two (start-up and the
first, unoverlapped batch). Rounds repeat the three modes in turn, so a change of machine load hits all
of them alike; compare the ratios. Results: benchmarks/README.md "Overlapped rollouts".
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from megaopd.config.step_time import predict  # the same prediction `megaopd plan --step-time` makes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny")
MODES = {"sync": [], "one_step_off": [], "async": []}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(env, max_batch_size: int, model: str = "student") -> tuple[subprocess.Popen, str]:
    port = _port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megaopd.cli",
            "serve",
            "--hf-dir",
            os.path.join(TINY, "models", model),
            "--port",
            str(port),
            "--num-threads",
            "1",
            "--max-batch-size",
            str(max_batch_size),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("megaopd serve did not come up in 120 s")


def run_mode(mode: str, args, env) -> dict:
    server, url = _serve(env, args.engine_batch)
    run_dir = tempfile.mkdtemp(prefix=f"overlap_{mode}_")
    try:
        overrides = [
            f"run.dir={run_dir}",
            "run.world_size=1",
            "student.tp=1",
            "reference.tp=1",
            "teacher.tp=1",
            f"trainer.max_steps={args.steps}",
            f"trainer.prompts_per_step={args.prompts}",
            "trainer.samples_per_prompt=2",
            f"trainer.micro_batch_size={2 * args.prompts}",
            "trainer.save_interval=100000",
            "trainer.eval_interval=0",
            "validation.path=''",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            "logging.tensorboard=false",
            "logging.progress_bar=off",
            "rollout.engine=remote",
            f"rollout.urls=[{url}]",
            f"rollout.mode={mode}",
            f"loss.off_policy_correction={args.correction}",
            f"trainer.seed={args.seed}",
            *MODES[mode],
        ]
        if mode == "async":
            overrides.append(f"rollout.max_staleness={args.max_staleness}")
        subprocess.run(
            [sys.executable, "-m", "megaopd.cli", "train", os.path.join(TINY, "stable_opd.yaml"), *overrides],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    finally:
        server.kill()
        server.wait()
    steps = [r for r in rows if "event" not in r and r["step"] > 2]

    def mean(key):
        vals = [r[key] for r in steps if key in r]
        return statistics.mean(vals) if vals else 0.0

    last = [r for r in rows if "event" not in r][-5:]  # learning: the last five steps
    return {
        "gen_alone": mean("time/rollout") if mode == "sync" else 0.0,
        "sync_s": mean("time/sync"),
        "rkl": statistics.mean(r.get("opd/reverse_kl", 0.0) for r in last),
        "trunc": statistics.mean(r.get("rollout/truncation_rate", 0.0) for r in last),
        "step": mean("time/step"),
        "rollout": mean("time/rollout"),
        "train": mean("time/train"),
        "gen": mean("pipeline/generate_s"),
        "wait": mean("pipeline/trainer_wait_s"),
        "idle": mean("pipeline/engine_idle_s"),
        "stale": mean("pipeline/staleness_mean"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--correction", default="none", help="loss.off_policy_correction of every mode")
    p.add_argument("--seed", type=int, default=1234, help="trainer.seed")
    p.add_argument(
        "--predict",
        metavar="GEN,REST,SYNC",
        default=None,
        help="only print predicted step times from these per-phase seconds (no runs), e.g. the "
        "1.5B H100 step of issue 25: 9.7,2.38,0.02",
    )
    p.add_argument(
        "--engine-batch",
        type=int,
        default=64,
        help="the server's --max-batch-size: smaller decodes in more chunks (longer generation)",
    )
    p.add_argument("--max-staleness", type=int, default=2, help="rollout.max_staleness of async")
    args = p.parse_args()
    if args.predict:
        gen, rest, sync = (float(x) for x in args.predict.split(","))
        print("| mode | predicted s/step | vs sync |\n|---|---:|---:|")
        for mode in MODES:
            print(
                f"| {mode} | {predict(mode, gen, rest, sync):.2f} | "
                f"{predict(mode, gen, rest, sync) / predict('sync', gen, rest, sync):.2f} |"
            )
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=ROOT)
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[str, list[dict]] = {m: [] for m in args.modes.split(",")}
    for _ in range(args.rounds):
        for mode in results:
            results[mode].append(run_mode(mode, args, env))
            print(f"  {mode}: {results[mode][-1]}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    base = statistics.mean(r["step"] for r in results["sync"]) if "sync" in results else None
    print(
        f"\nloss.off_policy_correction={args.correction}, trainer.seed={args.seed}; reverse KL and truncation: "
        "means of the last five steps"
    )
    print(
        "| mode | s/step | vs sync | predicted | rollout s | train s | generate s | trainer waited s | engine idle s "
        "| staleness | reverse KL | truncation |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    phases = None
    if "sync" in results:  # sync's own phases predict the others (the sync push counted apart)
        s0 = {k: statistics.mean(r[k] for r in results["sync"]) for k in results["sync"][0]}
        phases = (s0["gen_alone"], s0["step"] - s0["gen_alone"] - s0["sync_s"], s0["sync_s"])
    for mode, rs in results.items():
        m = {k: statistics.mean(r[k] for r in rs) for k in rs[0]}
        ratio = f"{m['step'] / base:.2f}" if base else "-"
        pred = f"{predict(mode, *phases):.2f}" if phases else "-"
        print(
            f"| {mode} | {m['step']:.2f} | {ratio} | {pred} | {m['rollout']:.2f} | {m['train']:.2f} | {m['gen']:.2f} | "
            f"{m['wait']:.2f} | {m['idle']:.2f} | {m['stale']:.2f} | {m['rkl']:.4f} | {m['trunc']:.3f} |"
        )


if __name__ == "__main__":
    main()
