"""End to end with `megaopd train` on the tiny models (one rank, SFT: the quickest
real run): a resume with a changed lr trains at the new lr and says so; a resume with another model is refused
in one line before the run folder is touched; a non-finite loss stops the run with one line naming the rank,
the term, the step and the rows (the traceback in RUN/logs), or is skipped and counted with
trainer.skip_nonfinite; the first warmup step trains at a non-zero lr, and train/lr is the
lr the step used."""

import json
import os
import subprocess
import sys

import pytest

from tests.trainer.tiny_models import DATA, ROOT, make_tiny_pair

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return make_tiny_pair(str(tmp_path_factory.mktemp("models")))


def _train(run_dir, student, *overrides, world=1):
    cmd = [
        sys.executable,
        "-m",
        "megaopd.cli",
        "train",
        os.path.join(ROOT, "examples", "tiny", "sft.yaml"),
        f"run.dir={run_dir}",
        f"student.path={student}",
        f"run.world_size={world}",
        "student.tp=1",
        "reference.tp=1",
        "trainer.max_steps=2",
        "trainer.save_interval=2",
        "trainer.eval_interval=0",
        "trainer.prompts_per_step=4",
        "trainer.micro_batch_size=2",
        "data.max_golden_len=64",
        f"data.sources=[{{path: {os.path.join(DATA, 'sft.jsonl')}, max_rows: 32}}]",
        "validation.max_new_tokens=8",
        "rollout.max_new_tokens=8",
        "logging.tensorboard=false",
        "logging.progress_bar=off",
        *overrides,
    ]
    return subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=900
    )


def _steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "event" not in r}


def test_resume_applies_a_new_lr_and_refuses_another_model(tiny_models, tmp_path):
    student, teacher = tiny_models
    run = str(tmp_path / "run")
    first = _train(run, student, "optimizer.lr=5e-4", "optimizer.warmup_steps=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    steps = _steps(run)
    # Warmup over 2 steps: step 1 trains at lr/2 (it trained at 0 before), step 2 at lr; logged as used.
    assert steps[1]["train/lr"] == pytest.approx(2.5e-4) and steps[2]["train/lr"] == pytest.approx(5e-4)

    resumed = _train(run, student, "optimizer.lr=1e-2", "optimizer.warmup_steps=2", "trainer.max_steps=3")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "config changed at step 2: optimizer.lr 0.0005 -> 0.01" in resumed.stdout
    assert "config changed at step 2: trainer.max_steps 2 -> 3" in resumed.stdout
    assert _steps(run)[3]["train/lr"] == pytest.approx(1e-2)  # the saved schedule kept 5e-4 before
    assert sorted(os.listdir(os.path.join(run, "configs"))) == ["step_000000.yaml", "step_000002.yaml"]
    with open(os.path.join(run, "config.yaml")) as f:
        stored = f.read()
    assert "lr: 0.01" in stored

    refused = _train(run, teacher, "optimizer.lr=1e-2", "optimizer.warmup_steps=2", "trainer.max_steps=4")
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        f"megaopd train: cannot resume {run} (checkpoint at step 3) with student.path {student} -> {teacher}; "
        f"{teacher}/config.json hidden_size 64 -> 96; {teacher}/config.json intermediate_size 128 -> 192: the "
        f"checkpoint was made of the old models and layout, so these cannot apply to it; start a new run.dir (e.g. "
        f"student.path=CHECKPOINT to start from its weights), or revert these keys to resume"
    )
    with open(os.path.join(run, "config.yaml")) as f:
        assert f.read() == stored  # untouched: the record still says what the checkpoint is
    assert sorted(os.listdir(os.path.join(run, "configs"))) == ["step_000000.yaml", "step_000002.yaml"]


def test_nonfinite_loss_stops_the_run_in_one_line_or_is_skipped(tiny_models, tmp_path):
    """lr 1e30: step 1 is finite and its update overflows the weights, so step 2's loss is not."""
    student, _ = tiny_models
    run = str(tmp_path / "nan")
    out = _train(run, student, "optimizer.lr=1e30", "optimizer.warmup_steps=0", "trainer.max_steps=3", world=2)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    # One line of ours (transformers' "Loading weights" progress bars may come before it), no traceback.
    lines = [line for line in out.stderr.splitlines() if line.startswith("megaopd")]
    assert len(lines) == 1 and lines[0].startswith("megaopd train: rank "), out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Error" not in out.stderr.replace(lines[0], "")
    assert "failed: FloatingPointError: step 2: non-finite loss sft/loss=" in lines[0], lines[0]
    assert "in the micro-batches of rows [golden " in lines[0] and "trainer.skip_nonfinite=true" in lines[0]
    rank = lines[0].split()[3]
    with open(os.path.join(run, "logs", f"rank_{rank}.err")) as f:
        assert "Traceback" in f.read()
    assert 2 not in _steps(run)  # the step stopped before its update and its log line

    run = str(tmp_path / "skip")
    out = _train(
        run,
        student,
        "optimizer.lr=1e30",
        "optimizer.warmup_steps=0",
        "trainer.max_steps=3",
        "trainer.skip_nonfinite=true",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = _steps(run)
    assert [steps[s]["train/skipped_nonfinite"] for s in (1, 2, 3)] == [0, 1, 1]
    assert "step 2: non-finite loss sft/loss=" in out.stdout and "update skipped (trainer.skip_nonfinite)" in out.stdout
