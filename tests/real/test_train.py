"""Two Stable-OPD steps of `megaopd train` on real models: the pruned SmolLM2 (layers 16-19 removed) as student
and reference, the full SmolLM2-135M-Instruct as teacher, on arithmetic word problems (tests/real/data) rendered
with the real chat template; rollouts stop at <|im_end|>. The shipped preset (examples/tiny/stable_opd.yaml:
its loss and weights) with models, data and budgets overridden: world 1, 2 prompts x 2 samples, 40 new tokens."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.real import reference

pytestmark = [pytest.mark.slow, pytest.mark.real]

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "arithmetic.jsonl")
PRESET = os.path.join(reference.ROOT, "examples", "tiny", "stable_opd.yaml")


def overrides(student: str, teacher: str, run_dir: str) -> list[str]:
    return [
        f"run.dir={run_dir}",
        "run.world_size=1",
        f"student.path={student}",
        "student.tp=1",
        "reference.tp=1",
        f"teacher.path={teacher}",
        "teacher.tp=1",
        "trainer.max_steps=2",
        "trainer.prompts_per_step=2",
        "trainer.samples_per_prompt=2",
        "trainer.micro_batch_size=4",
        "trainer.save_interval=2",
        "trainer.eval_interval=0",
        "rollout.max_new_tokens=40",
        "rollout.max_batch_size=4",
        f"data.sources=[{{path: {DATA}}}]",
        "data.max_prompt_len=256",
        "data.max_golden_len=128",
        "logging.tensorboard=false",
        "logging.samples_per_step=1",
    ]


def train_two_steps(args: list[str], run, timeout: float, preset: str = PRESET) -> tuple[str, dict[int, dict]]:
    """`megaopd train` of the preset with `args` (two steps): its log, and each step's metrics, checked to exit
    0 and log finite losses (total, OPD, SFT, reference KL), a non-zero gradient norm and responses of 1-40
    tokens."""
    cmd = [sys.executable, "-m", "megaopd.cli", "train", preset, *args]
    env = {**os.environ, "PYTHONPATH": reference.ROOT, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=reference.ROOT, check=False)
    log = p.stdout + p.stderr
    assert p.returncode == 0, f"megaopd train exited {p.returncode}:\n{log[-6000:]}"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = {r["step"]: r for r in records if "event" not in r and "loss/total" in r}
    assert sorted(steps) == [1, 2], sorted(steps)
    for step, m in steps.items():
        for key in ("loss/total", "loss/opd", "loss/sft", "loss/ref_kl", "train/grad_norm"):
            assert math.isfinite(m[key]), (step, key, m[key])
        assert m["train/grad_norm"] > 0 and 0 < m["rollout/response_length_mean"] <= 40, (step, m)
    return log, steps


def test_two_stable_opd_steps(smollm2, smollm2_student, tmp_path):
    run = tmp_path / "run"
    log, steps = train_two_steps(overrides(smollm2_student, smollm2, str(run)), run, timeout=1200)
    assert "rollouts stop at <|im_end|>=2" in log, log[-4000:]
    for m in steps.values():
        # the teacher is the full model, the student a pruned copy of it: the teacher scores the student's
        # responses, so its mean log-prob is a real number, and the student's own engine agrees with it
        assert math.isfinite(m["rollout/teacher_logprob_mean"]) and m["sync/logprob_gap_max"] < 1e-3, m
    assert (run / "checkpoints" / "latest").exists()
    print(
        "stable_opd on SmolLM2: "
        + "; ".join(
            f"step {s}: loss {m['loss/total']:.4f}, sft {m['loss/sft']:.3f}, response "
            f"{m['rollout/response_length_mean']:.1f} "
            f"tokens, {m['time/step']:.1f} s"
            for s, m in sorted(steps.items())
        )
    )
