"""Resume, preemption and the run-folder faults with a LoRA student (issue 55), end to end on real tiny runs
(`megaopd train`, world 1, stable_opd with student.lora on every linear at rank 4): the checkpoint holds the base
and the adapters with their Adam state, so

  - a resumed run's steps equal an uninterrupted run's (the step after the resume reads the restored adapters, the
    one after it also their restored Adam moments);
  - SIGTERM mid-run saves the step it is at, exits 0, and the run resumes from it to the uninterrupted numbers;
  - resuming with LoRA off, another rank or other targets is refused in one line naming the setting, before
    anything is written;
  - a lost `latest` and a truncated shard behave as for full training (tests/trainer/test_run_folder_faults.py).

    pytest -m slow tests/trainer/test_lora_faults.py
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megaopd.models import manifest as mf
from tests.trainer._procs import PRESET, copy_run, one_rank_run, step_rows, train, train_args
from tests.trainer.tiny_models import ROOT, make_tiny_pair

LORA = ["student.lora.enabled=true", "student.lora.rank=4", "student.lora.alpha=8", "student.lora.targets=[all]"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
COMPARED = (
    "loss/total",
    "loss/ref_kl",
    "rollout/response_length_mean",
    "rollout/student_logprob_mean",
    "rollout/teacher_logprob_mean",
    "train/grad_norm",
)


def _overrides(base, models, run_dir, steps, extra=()):
    """A one-rank LoRA run (lr 1e-2: the adapters move enough in a few steps for a lost Adam state to show)."""
    return one_rank_run(base, models, run_dir, steps, ["optimizer.lr=1e-2", *LORA, *extra])


def _train(overrides):
    return train(overrides, env=ONE_THREAD)


def _by_step(run):
    return {r["step"]: r for r in step_rows(run)}


def _checkpoints(run):
    return sorted(os.listdir(os.path.join(run, "checkpoints")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(base folder, models, a LoRA run after 3 steps (step_000002, step_000003 kept), the same run uninterrupted
    to 5 steps)."""
    base = tmp_path_factory.mktemp("lora_faults")
    models = make_tiny_pair(str(base / "models"))
    three, five = str(base / "three"), str(base / "five")
    for run, steps in ((three, 3), (five, 5)):
        r = _train(_overrides(base, models, run, steps))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _checkpoints(three) == ["latest", "step_000002", "step_000003"]
    meta = json.load(open(os.path.join(three, "checkpoints", "step_000003", "megaopd_checkpoint.json")))
    assert meta["lora"]["rank"] == 4, meta  # the checkpoint says what its adapters are
    return base, models, three, five


def _same_steps(got, want, steps):
    for s in steps:
        for key in COMPARED:
            assert got[s][key] == pytest.approx(want[s][key], rel=1e-4, abs=1e-6), (s, key, got[s][key], want[s][key])


def test_the_adapters_settings_cannot_change_on_resume(tmp_path):
    """resume_config: student.lora's enabled, rank, alpha and targets made the checkpoint's tensors (refused); its
    dropout applies."""
    from megaopd.config import load_config
    from megaopd.config.schema import MegaOPDConfig
    from megaopd.trainer.resume_config import config_changes, unappliable

    cfg = load_config(MegaOPDConfig, PRESET, LORA)
    old = {"student": {"lora": {"enabled": True, "rank": 4, "alpha": 8.0, "targets": ["all"], "dropout": 0.0}}}
    for key, value, refused in (
        ("enabled", False, True),
        ("rank", 8, True),
        ("alpha", 16.0, True),
        ("targets", ["qkv"], True),
        ("dropout", 0.1, False),
    ):
        new = {"student": {"lora": {**old["student"]["lora"], key: value}}}
        got = unappliable(config_changes(old, new), cfg, str(tmp_path))
        assert bool(got) is refused and (not got or got[0].startswith(f"student.lora.{key} ")), (key, got)


@pytest.mark.slow
def test_resumed_lora_run_equals_the_uninterrupted_one(runs, tmp_path):
    base, models, three, five = runs
    run = copy_run(three, tmp_path)
    r = _train(_overrides(base, models, run, 5))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 3" in r.stdout, r.stdout[-2000:]
    assert [s["step"] for s in step_rows(run)] == [1, 2, 3, 4, 5]  # each step once
    # Step 4 reads the restored adapters; step 5 also the Adam moments restored with them (fresh moments would
    # make step 4's update lr * sign(g), the bias-corrected first step, and step 5's numbers differ).
    _same_steps(_by_step(run), _by_step(five), (4, 5))


@pytest.mark.slow
def test_sigterm_mid_run_saves_exits_zero_and_resumes_to_the_uninterrupted_numbers(runs, tmp_path):
    base, models, _, five = runs
    run = str(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, *train_args(_overrides(base, models, run, 50))],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, **ONE_THREAD},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not (os.path.exists(os.path.join(run, "metrics.jsonl")) and len(step_rows(run)) >= 2):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the run did not log step 2"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)  # Slurm's preemption: every process of the step
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    saved = int(open(os.path.join(run, "checkpoints", "latest")).read().split("_")[-1])
    assert f"preemption signal received: checkpoint of step {saved} saved" in out, out[-3000:]
    assert 2 <= saved < 5, saved  # the test compares up to the uninterrupted run's step 5
    r = _train(_overrides(base, models, run, saved + 1))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"at step {saved}" in r.stdout
    assert [s["step"] for s in step_rows(run)] == list(range(1, saved + 2))
    _same_steps(_by_step(run), _by_step(five), range(1, saved + 2))


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, named",
    [
        (["student.lora.enabled=false"], "student.lora.enabled True -> False"),
        (["student.lora.rank=8"], "student.lora.rank 4 -> 8"),
        (["student.lora.targets=[qkv,proj]"], "student.lora.targets"),
    ],
)
def test_resume_with_other_adapters_is_refused_in_one_line(runs, tmp_path, change, named):
    base, models, three, _ = runs
    run = copy_run(three, tmp_path)
    before = {p: os.path.getmtime(os.path.join(run, p)) for p in ("metrics.jsonl", "config.yaml")}
    r = _train(_overrides(base, models, run, 4, change))
    assert r.returncode != 0
    lines = [line for line in (r.stdout + r.stderr).splitlines() if named in line]
    assert lines and "cannot resume" in lines[0], (r.stdout + r.stderr)[-3000:]
    assert "Traceback" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    assert _checkpoints(run) == ["latest", "step_000002", "step_000003"]  # nothing written
    assert before == {p: os.path.getmtime(os.path.join(run, p)) for p in before}


@pytest.mark.slow
def test_lost_latest_on_a_lora_run_resumes_from_the_newest_complete_step(runs, tmp_path):
    base, models, three, five = runs
    run = copy_run(three, tmp_path)
    os.remove(os.path.join(run, "checkpoints", "latest"))
    r = _train(_overrides(base, models, run, 4))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "latest is missing: resuming from the newest complete step" in out and "at step 3" in out, out[-3000:]
    assert _checkpoints(run) == ["latest", "step_000003", "step_000004"]
    assert all(mf.verify(os.path.join(run, "checkpoints", s)) is None for s in ("step_000003", "step_000004"))
    assert [s["step"] for s in step_rows(run)] == [1, 2, 3, 4]
    _same_steps(_by_step(run), _by_step(five), (4,))


@pytest.mark.slow
def test_truncated_shard_of_a_lora_run_names_the_file_and_the_previous_step(runs, tmp_path):
    base, models, three, _ = runs
    run = copy_run(three, tmp_path)
    shard = os.path.join(run, "checkpoints", "step_000003", "model", "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    r = _train(_overrides(base, models, run, 4))
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert f"{shard} is {os.path.getsize(shard)} bytes" in out, out[-3000:]
    assert "newest step that verifies is" in out and "step_000002 (step 2)" in out, out[-3000:]
    assert "EOFError" not in out
    assert len(step_rows(run)) == 3
    assert _checkpoints(run) == ["latest", "step_000002", "step_000003"]
