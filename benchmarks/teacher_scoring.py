"""Teacher scoring time per step on the tiny setup: the in-job Megatron teacher vs the same weights behind
`megaopd serve`, and how much of the served scoring overlaps the actor's own log-prob pass.

    PYTHONPATH=. python benchmarks/teacher_scoring.py [--steps 4] [--servers 1]

Runs examples/tiny/stable_opd.yaml (student TP=2 on 2 gloo workers, teacher TP=1, 32 prompts x 4
samples, 128 new tokens) for --steps steps, once in the job and once with teacher.engine=remote over
--servers `megaopd serve` processes (one torch thread each), and reads the trainer's per-step times:
  time/actor_logprobs    the actor's log pi_old pass
  time/teacher           what the step waits for the teacher after the actor pass (in-job: the whole pass)
  time/teacher_remote    served: wall time of the scoring thread, started before the actor pass
overlap = (teacher_remote - teacher) / teacher_remote: the share of the served scoring hidden behind the
actor pass. The first step is left out (start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _serve(port_hint: int):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megaopd.cli",
            "serve",
            "--hf-dir",
            os.path.join(ROOT, "examples/tiny/models/teacher"),
            "--port",
            "0",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    while True:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError("megaopd serve exited")
        if "http://" in line:
            url = "http://" + line.split("http://", 1)[1].split()[0].rstrip("/.,")
            break
    import urllib.request

    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return proc, url
        except Exception:  # noqa: BLE001 - still loading
            time.sleep(0.2)
    raise RuntimeError("megaopd serve did not become healthy")


def _times(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "event" not in r and "time/teacher" in r]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--servers", type=int, default=1)
    args = ap.parse_args()
    from megaopd.config import load_config
    from megaopd.config.schema import MegaOPDConfig
    from megaopd.parallel.launch import spawn
    from tests.trainer import _workers

    tmp = tempfile.mkdtemp(prefix="megaopd_teacher_bench_")
    base = [
        f"trainer.max_steps={args.steps}",
        "trainer.eval_interval=0",
        "trainer.save_interval=1000",
        "validation.path=''",
        "logging.tensorboard=false",
        "logging.progress_bar=off",
    ]
    procs, urls = [], []
    for i in range(args.servers):
        p, u = _serve(i)
        procs.append(p)
        urls.append(u)
    try:
        cfgs = [
            load_config(
                MegaOPDConfig,
                os.path.join(ROOT, "examples/tiny/stable_opd.yaml"),
                base + [f"run.dir={tmp}/{name}"] + extra,
            )
            for name, extra in (
                ("in_job", []),
                ("served", ["teacher.engine=remote", f"teacher.urls=[{','.join(urls)}]"]),
            )
        ]
        spawn(_workers.run_presets, 2, args=(cfgs,), timeout=3600)
    finally:
        for p in procs:
            p.kill()
    print("| teacher | steps | actor log-prob pass s | teacher wait after it s | served scoring s | overlapped |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in ("in_job", "served"):
        rows = _times(os.path.join(tmp, name))[1:]
        mean = lambda k, rows=rows: sum(r.get(k, 0.0) for r in rows) / len(rows)  # noqa: E731
        actor, wait, remote = mean("time/actor_logprobs"), mean("time/teacher"), mean("time/teacher_remote")
        overlap = f"{max(remote - wait, 0) / remote:.0%}" if remote else "-"
        label = "in-job (Megatron, TP=1)" if name == "in_job" else f"served ({args.servers} megaopd serve)"
        print(f"| {label} | {len(rows)} | {actor:.3f} | {wait:.3f} | {remote:.3f} | {overlap} |")


if __name__ == "__main__":
    main()
