"""The tiny multi-turn preset (examples/tiny/agentic.yaml) killed with SIGKILL after its step-1 checkpoint
resumes and reaches the uninterrupted run's step-2 metrics, trajectory metrics included (trajectories are
seeded per step, turn and request). Every environment answers every turn (always_answers/sitecustomize.py),
so the trajectories are multi-turn."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.trainer.test_end_to_end import _checkpointed, _wait_for
from tests.trainer.tiny_models import ROOT

PRESET = os.path.join(ROOT, "examples", "tiny", "agentic.yaml")
HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "always_answers")
KEYS = (
    "loss/total",
    "loss/opd",
    "loss/sft",
    "loss/ref_kl",
    "train/grad_norm",
    "rollout/response_length_mean",
    "rollout/student_logprob_mean",
    "rollout/teacher_logprob_mean",
    "rollout/reward_mean",
    "traj/turns_mean",
    "traj/tool_calls_mean",
    "traj/env_token_share",
    "traj/truncated_turns_rate",
    "traj/truncated_tokens_rate",
)


def _cmd(run_dir):
    return [
        sys.executable,
        "-m",
        "megaopd.cli",
        "train",
        PRESET,
        f"run.dir={run_dir}",
        "trainer.max_steps=2",
        "trainer.save_interval=1",
        "trainer.prompts_per_step=2",
        "trainer.samples_per_prompt=2",
        "trainer.micro_batch_size=4",
        "trainer.eval_interval=0",
        "rollout.max_turns=2",
        "logging.tensorboard=false",
        "logging.progress_bar=off",
    ]


def _step(run_dir, step):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return next(r for r in map(json.loads, f) if r.get("step") == step and "event" not in r and "loss/total" in r)


@pytest.mark.slow
def test_agentic_run_resumes_after_sigkill_with_the_same_metrics(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HOOK, ROOT]))
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    quiet = dict(cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    subprocess.run(_cmd(full), check=True, **quiet)
    proc = subprocess.Popen(
        _cmd(killed),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert _wait_for(lambda: _checkpointed(killed, 1), 600, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers, mid-run, no chance to save
    proc.wait()
    subprocess.run(_cmd(killed), check=True, **quiet)
    a, b = _step(full, 2), _step(killed, 2)
    assert a["traj/turns_mean"] > 1, a
    for key in KEYS:
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
