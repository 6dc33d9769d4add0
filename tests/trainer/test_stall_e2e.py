"""An engine that stops, against the real trainer (`megaopd train`, its own process) and a real `megaopd serve`
process frozen with SIGSTOP in the middle of a run (a stopped engine must neither stall training silently nor
block preemption):
  - the step's rollout ends within rollout.stall_timeout_s with one error naming the engine, instead of
    waiting out request_timeout_s and its retries (10+ minutes with the defaults);
  - SIGTERM during that stall (Slurm's preemption) is honoured within seconds: the last complete step is
    checkpointed and the trainer exits 0 (two ranks: rank 0's abandoned wait reaches the other through the
    rollout's broadcast)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.trainer.tiny_models import ROOT

TINY = os.path.join(ROOT, "examples", "tiny")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path):
    """`megaopd serve` of the tiny student in its own process; yields (process, url)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megaopd.cli",
            "serve",
            "--hf-dir",
            os.path.join(TINY, "models", "student"),
            "--port",
            str(port),
            "--num-threads",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "megaopd serve did not become healthy"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
        log.close()


def _train(tmp_path, url, overrides):
    run = str(tmp_path / "run")
    args = [
        f"run.dir={run}",
        "rollout.engine=remote",
        f"rollout.urls=[{url}]",
        "trainer.max_steps=50",
        "trainer.prompts_per_step=4",
        "trainer.samples_per_prompt=2",
        "trainer.micro_batch_size=4",
        "rollout.max_new_tokens=16",
        "trainer.save_interval=1000",
        "trainer.eval_interval=0",
        "validation.path=''",
        "logging.tensorboard=false",
        "logging.progress_bar=off",
        "trainer.pack_sequences=false",
    ] + overrides
    out = open(tmp_path / "train.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "megaopd.cli", "train", os.path.join(TINY, "stable_opd.yaml"), *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return proc, run, out


def _steps(run):
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r["step"] for r in map(json.loads, f) if "event" not in r]


def _after_step_one(proc, run, tmp_path, timeout=600):
    """Waits until step 1 is logged (its sync done: step 2's rollout is next)."""
    deadline = time.monotonic() + timeout
    while 1 not in _steps(run):
        assert proc.poll() is None, (tmp_path / "train.log").read_text()[-5000:]
        assert time.monotonic() < deadline, "the trainer did not finish step 1"
        time.sleep(0.05)


def _stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_stopped_engine_ends_the_step_with_one_error_naming_it(tmp_path, served):
    server, url = served
    stall = 3.0
    proc, run, out = _train(
        tmp_path, url, ["run.world_size=1", "student.tp=1", "reference.tp=1", f"rollout.stall_timeout_s={stall}"]
    )
    try:
        _after_step_one(proc, run, tmp_path)
        server.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        while "made no progress" not in (tmp_path / "train.log").read_text() and proc.poll() is None:
            assert time.monotonic() - t0 < 120, "no stall error"
            time.sleep(0.05)
        took = time.monotonic() - t0
        rc = proc.wait(timeout=120)
        print(f"stall error after {took:.1f} s, exit after {time.monotonic() - t0:.1f} s")
    finally:
        _stop(proc)
        out.close()
    log = (tmp_path / "train.log").read_text()
    assert rc != 0, log[-3000:]
    assert took < stall + 3.0, (took, log[-3000:])  # was: request_timeout_s (600 s) and retries
    assert log.count("made no progress") == 1, log[-3000:]
    line = next(x for x in log.splitlines() if "made no progress" in x)
    assert f"rollout.urls[0] ({url})" in line and "stall_timeout_s" in line, line


@pytest.mark.slow
def test_sigterm_during_a_stall_checkpoints_the_last_complete_step_and_exits_0(tmp_path, served):
    server, url = served
    proc, run, out = _train(tmp_path, url, ["run.world_size=2", "rollout.stall_timeout_s=120"])
    try:
        _after_step_one(proc, run, tmp_path)
        server.send_signal(signal.SIGSTOP)
        time.sleep(1.0)  # rank 0 now waits on the stopped engine (step 2's rollout)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        rc = proc.wait(timeout=120)
        took = time.monotonic() - t0
        print(f"SIGTERM to exit: {took:.1f} s")
    finally:
        _stop(proc)
        out.close()
    log = (tmp_path / "train.log").read_text()
    assert rc == 0, log[-3000:]
    assert took < 15.0, (took, log[-3000:])  # Slurm's grace: seconds, not the request's 600 s
    ckpt = os.path.join(run, "checkpoints")
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip().endswith("step_000001")
    assert os.path.isdir(os.path.join(ckpt, "step_000001")) and _steps(run) == [1]
    assert "checkpoint of step 1 saved" in log, log[-3000:]
