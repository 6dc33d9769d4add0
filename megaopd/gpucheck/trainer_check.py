"""Part c: the trainer end to end through its command line (`python -m megaopd.cli train CONFIG key=value ...`),
killed mid-run with SIGKILL and started again: it must resume from its last checkpoint and finish.

Only the CLI, the config keys and the run folder's files are used (RUN/metrics.jsonl, RUN/checkpoints/latest),
so the trainer's internals can change freely. The models are random HF directories built by
megaopd.gpucheck.build (Qwen2.5 shapes on the GPU, tiny ones in --quick).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from megaopd.gpucheck.build import REPO, write_hf_dir
from megaopd.gpucheck.report import Table

YAML = os.path.join(REPO, "scripts", "gpu_check", "stable_opd_gpu.yaml")


@dataclass
class TrainerSetup:
    """What part c runs: model shapes and the overrides on top of the YAML."""

    student_shape: str
    teacher_shape: str
    vocab: int
    weights_dtype: str
    overrides: list[str] = field(default_factory=list)
    timeout_s: float = 240.0
    """Per trainer process."""


def gpu_setup() -> TrainerSetup:
    return TrainerSetup("qwen2.5-0.5b", "qwen2.5-1.5b", 151936, "bfloat16")


def quick_setup() -> TrainerSetup:
    """CPU smoke mode: tiny models, float32, gloo; the distributed optimizer is GPU-only in megatron-core 0.16."""
    return TrainerSetup(
        "tiny-student",
        "tiny-teacher",
        512,
        "float32",
        overrides=[
            "student.dtype=float32",
            "reference.dtype=float32",
            "teacher.dtype=float32",
            "optimizer.use_distributed_optimizer=false",
            "optimizer.lr=1e-4",
            "trainer.prompts_per_step=4",
            "trainer.samples_per_prompt=2",
            "trainer.micro_batch_size=4",
            "rollout.max_new_tokens=24",
            "rollout.parity_tolerance=1e-3",
            "data.max_prompt_len=96",
            "data.max_golden_len=96",
        ],
        timeout_s=300.0,
    )


class GpuMemoryPoll:
    """Largest `nvidia-smi` memory.used (MiB) seen while running: the whole GPU, CUDA contexts included."""

    def __init__(self, period_s: float = 0.5):
        self.peak_mib = None
        self._stop = threading.Event()
        self._thread = None
        self.period_s = period_s

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
                used = max(float(x) for x in out.split())
                self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)
            except Exception:  # noqa: BLE001 - a missed sample only loses a sample
                pass
            self._stop.wait(self.period_s)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        return False


def train_command(config: str, overrides: list[str]) -> list[str]:
    """`megaopd train` without the installed entry point (the GPU machine has the source tree only)."""
    return [sys.executable, "-m", "megaopd.cli", "train", config, *overrides]


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by the kill
    return [r for r in out if "event" not in r and "time/step" in r]


def latest_step(run_dir: str) -> int | None:
    pointer = os.path.join(run_dir, "checkpoints", "latest")
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    try:
        return int(name.rsplit("_", 1)[-1])
    except ValueError:
        return None


def run_trainer(cmd: list[str], log_path: str, timeout_s: float, kill_when=None) -> tuple[int | None, bool]:
    """Runs the trainer in its own process group; kill_when() -> True kills that group with SIGKILL.
    Returns (exit code or None when killed/timed out, killed_on_purpose)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            if kill_when is not None and kill_when():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return None, True
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                log.write(f"\n[gpu_check] killed after the {timeout_s:.0f} s timeout\n")
                return None, False
            time.sleep(0.5)
        return proc.returncode, False


def _tail(path: str, n: int = 3) -> str:
    try:
        with open(path) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        return " // ".join(lines[-n:])[-300:]
    except OSError:
        return "(no log)"


def build_models(setup: TrainerSetup, workdir: str, device: str) -> tuple[str, str]:
    import torch

    dtype = getattr(torch, setup.weights_dtype)
    student = write_hf_dir(
        os.path.join(workdir, f"student_{setup.student_shape}"), setup.student_shape, setup.vocab, device, dtype, seed=1
    )
    teacher = write_hf_dir(
        os.path.join(workdir, f"teacher_{setup.teacher_shape}"), setup.teacher_shape, setup.vocab, device, dtype, seed=2
    )
    return student, teacher


def check_trainer(table: Table, setup: TrainerSetup, workdir: str, device: str) -> None:
    dt = setup.weights_dtype
    with table.guard("c", "build models", dt):
        t = time.time()
        student, teacher = build_models(setup, workdir, device)
        table.info(
            "c",
            f"student {setup.student_shape}, teacher {setup.teacher_shape}, V={setup.vocab}",
            dt,
            "build s",
            time.time() - t,
        )
    if not table.rows or table.rows[-1].status == "FAIL":
        return
    run_dir = os.path.join(workdir, "run_c")
    shutil.rmtree(run_dir, ignore_errors=True)
    max_steps, save_interval = 10, 5
    overrides = [
        f"run.dir={run_dir}",
        f"student.path={student}",
        f"teacher.path={teacher}",
        f"trainer.max_steps={max_steps}",
        f"trainer.save_interval={save_interval}",
        *setup.overrides,
    ]
    cmd = train_command(YAML, overrides)
    print("[gpu_check] part c:", " ".join(cmd), flush=True)

    def killed_after_checkpoint() -> bool:
        # Kill during the step after the first checkpoint's successor: the restart must redo that step.
        ck = latest_step(run_dir)
        return ck is not None and any(r["step"] > ck for r in read_metrics(run_dir))

    with table.guard("c", "trainer run 1 (killed)", dt), GpuMemoryPoll() as mem1:
        t = time.time()
        rc, killed = run_trainer(cmd, os.path.join(workdir, "train_1.log"), setup.timeout_s, killed_after_checkpoint)
        table.info("c", "run 1 wall time to kill", dt, "s", time.time() - t)
        if not killed:
            table.fail(
                "c",
                "run 1 killed mid-run",
                dt,
                f"exit {rc} before a checkpoint + 1 step: {_tail(os.path.join(workdir, 'train_1.log'))}",
            )
            return
        steps_before = [r["step"] for r in read_metrics(run_dir)]
        ckpt = latest_step(run_dir)
        table.info("c", "run 1 killed (SIGKILL) after step", dt, "last logged step", max(steps_before))
        table.eq("c", "checkpoint before the kill", dt, "latest checkpoint step", ckpt, save_interval)
    restart_time = time.time()
    with table.guard("c", "trainer run 2 (resume)", dt), GpuMemoryPoll() as mem2:
        rc, _ = run_trainer(cmd, os.path.join(workdir, "train_2.log"), setup.timeout_s)
        table.eq("c", "resumed run exit code", dt, "exit code", rc, 0)
        if rc != 0:
            table.fail("c", "resumed run", dt, _tail(os.path.join(workdir, "train_2.log")))
            return
        after = [r for r in read_metrics(run_dir) if r.get("time", 0) >= restart_time]
        table.eq(
            "c",
            "resume from the checkpoint",
            dt,
            "first step after restart",
            after[0]["step"] if after else None,
            save_interval + 1,
        )
        table.eq("c", "run finished", dt, "last step", after[-1]["step"] if after else None, max_steps)
        table.eq("c", "checkpoint at the end", dt, "latest checkpoint step", latest_step(run_dir), max_steps)
        records = read_metrics(run_dir)
        losses = [r.get("loss/total") for r in records]
        table.eq(
            "c",
            "loss finite every step",
            dt,
            "non-finite or missing losses",
            sum(1 for v in losses if v is None or not math.isfinite(v)),
            0,
        )
        gaps = [r["sync/logprob_gap_max"] for r in records if r.get("sync/logprob_gap_max") is not None]
        if gaps:
            tol = float(
                next(
                    (o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("rollout.parity_tolerance=")), 0.1
                )
            )
            table.le("c", "weight sync + parity probe", dt, "max engine-actor log-prob gap", max(gaps), tol)
        else:
            table.info("c", "weight sync + parity probe", dt, "sync/logprob_gap_max", "not logged by this trainer")
        for key in ("time/step", "time/rollout", "time/actor_logprobs", "time/teacher", "time/train", "time/sync"):
            vals = [r[key] for r in after[1:] if r.get(key) is not None]  # the restart's first step warms up
            if vals:
                table.info("c", f"mean {key} (resumed run, after its first step)", dt, "s", sum(vals) / len(vals))
    for name, mem in (("run 1", mem1), ("run 2", mem2)):
        if mem.peak_mib is not None:
            table.info("c", f"peak GPU memory ({name}, nvidia-smi)", dt, "GiB", mem.peak_mib / 1024)
