"""End-to-end runs of `megaopd train` on tiny random models: every algorithm preset at TP=2, resume after
SIGKILL, preemption by a signal to every process, and the start-up errors a user meets first."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from megaopd.parallel.launch import spawn
from tests.trainer import _workers
from tests.trainer.test_layouts import tiny_overrides
from tests.trainer.tiny_models import ROOT, make_tiny_pair

PRESETS = ["sft", "opd", "opd_kl", "stable_opd", "lsm", "lsm_student_topk", "gkd", "grpo"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return make_tiny_pair(str(tmp_path_factory.mktemp("models")))


def _preset(name):
    return os.path.join(ROOT, "examples", "tiny", f"{name}.yaml")


def _train_cmd(preset, overrides):
    return [sys.executable, "-m", "megaopd.cli", "train", preset, *overrides]


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _steps(run_dir):
    by_step = {}
    for r in _records(run_dir):
        if "event" not in r:
            by_step[r["step"]] = r
    return by_step


@pytest.mark.slow
def test_every_algorithm_preset_runs_at_tp2(tiny_models, tmp_path):
    student, teacher = tiny_models
    cfgs = []
    for name in PRESETS:
        overrides = tiny_overrides(tmp_path, student, teacher, name) + [
            "run.world_size=2",
            "student.tp=2",
            "reference.tp=2",
        ]
        overrides = [o for o in overrides if not o.startswith("loss.mask_first_tokens")]
        if name in ("sft", "grpo"):
            overrides = [o for o in overrides if not o.startswith("teacher.path")]
        if name == "sft":
            overrides.append("trainer.eval_interval=2")
            overrides.append(f"validation.path={os.path.join(ROOT, 'examples', 'tiny', 'data', 'val.jsonl')}")
            overrides += ["validation.max_problems=4", "validation.max_new_tokens=8"]
        cfgs.append(load_config(MegaOPDConfig, _preset(name), overrides))
    results = spawn(_workers.run_presets, 2, args=(cfgs,), timeout=1500)[0]
    for name, metrics in zip(PRESETS, results):
        assert math.isfinite(metrics["loss/total"]), (name, metrics)
        if name not in ("stable_opd", "opd_kl"):
            assert metrics[f"loss/{'lsm' if name.startswith('lsm') else name}"] == metrics["loss/total"], name
        if name == "grpo" and metrics["rollout/reward_mean"] in (0.0, 1.0):
            # Random models: every group's rewards are equal, so every advantage and the gradient are 0.
            assert metrics["train/grad_norm"] == 0.0
        else:
            assert metrics["train/grad_norm"] > 0, name
        if name != "sft":
            assert 0.0 <= metrics["rollout/truncation_rate"] <= 1.0
            assert metrics["sync/logprob_gap_max"] < 1e-3, (name, metrics["sync/logprob_gap_max"])
    # Every run wrote its folder: config, metrics, a checkpoint and the final HF export.
    for name in PRESETS:
        run = tmp_path / name
        assert (run / "checkpoints" / "latest").exists(), name
        assert (run / "hf" / "config.json").exists(), name
        assert len(_steps(str(run))) >= 2, name
    required = [
        "rollout/truncation_rate",
        "rollout/repetition_rate",
        "rollout/response_length_mean",
        "rollout/student_logprob_mean",
        "rollout/teacher_logprob_mean",
        "rollout/advantage_mean",
        "adv/regular_mean",
        "adv/repetitive_mean",
        "adv/repetitive_token_share",
        "overlap/ratio",
        "overlap/mass",
        "overlap/entropy_gap",
        "sync/logprob_gap_mean",
        "sync/logprob_gap_max",
        "loss/total",
        "loss/opd",
        "loss/sft",
        "loss/ref_kl",
        "train/grad_norm",
        "train/lr",
        "time/rollout",
        "time/teacher",
        "time/train",
        "time/sync",
        "time/step",
    ]
    stable = _steps(str(tmp_path / "stable_opd"))[2]
    assert not [k for k in required if k not in stable], [k for k in required if k not in stable]
    val = _steps(str(tmp_path / "sft"))
    assert {"val/accuracy", "val/truncation_rate", "val/repetition_rate"} <= set(val[0]) & set(val[2])


def _wait_for(predicate, timeout, proc):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            raise AssertionError(f"training exited early with {proc.returncode}: {proc.stdout.read()[-3000:]}")
        time.sleep(0.5)
    return False


def _checkpointed(run_dir, step):
    path = os.path.join(run_dir, "metrics.jsonl")
    return os.path.exists(path) and any(r.get("event") == "checkpoint" and r["step"] >= step for r in _records(run_dir))


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(tiny_models, tmp_path):
    student, teacher = tiny_models
    common = (
        tiny_overrides(tmp_path, student, teacher, "x")[:2]
        + [o for o in tiny_overrides(tmp_path, student, teacher, "x")[3:]]
        + ["trainer.max_steps=4", "trainer.save_interval=2", "run.world_size=2", "student.tp=2", "reference.tp=2"]
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    subprocess.run(
        _train_cmd(_preset("stable_opd"), common + [f"run.dir={full}"]),
        check=True,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=900,
    )
    proc = subprocess.Popen(
        _train_cmd(_preset("stable_opd"), common + [f"run.dir={killed}"]),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert _wait_for(lambda: _checkpointed(killed, 2), 600, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers, mid-run, no chance to save
    proc.wait()
    subprocess.run(
        _train_cmd(_preset("stable_opd"), common + [f"run.dir={killed}"]),
        check=True,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=900,
    )
    a, b = _steps(full)[4], _steps(killed)[4]
    for key in (
        "loss/total",
        "rollout/response_length_mean",
        "rollout/student_logprob_mean",
        "rollout/teacher_logprob_mean",
        "train/grad_norm",
        "loss/ref_kl",
    ):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key

    # A training checkpoint is a model checkpoint: the converter turns the last one into exactly the
    # HF directory the run exported at its end.
    from safetensors.torch import load_file

    out = str(tmp_path / "converted")
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "convert_megatron_to_hf.py"),
            "--ckpt",
            os.path.join(killed, "checkpoints", "step_000004"),
            "--out",
            out,
        ],
        check=True,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=600,
    )
    converted = {
        k: v for f in os.listdir(out) if f.endswith(".safetensors") for k, v in load_file(os.path.join(out, f)).items()
    }
    exported = {
        k: v
        for f in os.listdir(os.path.join(killed, "hf"))
        if f.endswith(".safetensors")
        for k, v in load_file(os.path.join(killed, "hf", f)).items()
    }
    assert converted.keys() == exported.keys()
    assert all((converted[k] == exported[k]).all() for k in converted)


@pytest.mark.slow
def test_preemption_signal_to_every_process_saves_exits_zero_and_resumes(tiny_models, tmp_path):
    """USR1 to every process of the run after a first checkpoint, as srun delivers the time-limit warning to
    every process of a step: the ranks save the step they are at and exit 0, and the run resumes from it.
    Every process includes the helpers the ranks started (megatron's checkpoint-result Manager since the
    first save, the answer checker): one that dies of the signal must not fail the save."""
    student, teacher = tiny_models
    run = str(tmp_path / "preempted")
    overrides = tiny_overrides(tmp_path, student, teacher, "preempted") + [
        "run.world_size=1",
        "student.tp=1",
        "reference.tp=1",
        "teacher.tp=1",
        "trainer.save_interval=1",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(
        _train_cmd(_preset("stable_opd"), overrides + ["trainer.max_steps=50"]),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert _wait_for(lambda: _checkpointed(run, 1), 600, proc)
    os.killpg(proc.pid, signal.SIGUSR1)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    saved = [r["step"] for r in _records(run) if r.get("event") == "checkpoint"]
    assert "preemption signal received" in out and saved[-1] < 50, out[-2000:]
    resumed = subprocess.run(
        _train_cmd(_preset("stable_opd"), overrides + [f"trainer.max_steps={saved[-1] + 1}"]),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert max(_steps(run)) == saved[-1] + 1


def _cli_error(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(
        [sys.executable, "-m", "megaopd.cli", "train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return r.returncode, r.stderr


def test_missing_teacher_path_is_one_clear_line(tiny_models, tmp_path):
    student, teacher = tiny_models
    overrides = tiny_overrides(tmp_path, student, teacher, "bad")
    overrides = [o if not o.startswith("teacher.path") else "teacher.path=/no/such/teacher" for o in overrides]
    code, err = _cli_error([_preset("stable_opd"), *overrides], tmp_path)
    assert code == 2
    lines = [x for x in err.strip().splitlines() if x.startswith("megaopd train:")]
    assert lines == [
        "megaopd train: teacher.path='/no/such/teacher' does not exist: fix the path or convert the "
        "model first (tools/convert_hf_to_megatron.py)"
    ], err[-2000:]


@pytest.mark.slow
def test_tokenizer_mismatch_and_bad_data_stop_before_models_load(tiny_models, tmp_path):
    from megaopd.models.presets import make_tokenizer

    student, teacher = tiny_models
    other = tmp_path / "other_teacher"
    shutil.copytree(teacher, other)
    for f in os.listdir(other):
        if f.startswith("tokenizer") or f == "chat_template.jinja":
            os.remove(other / f)
    make_tokenizer(256, str(other))  # same vocabulary size, different token-to-id map
    overrides = tiny_overrides(tmp_path, student, str(other), "mismatch") + [
        "run.world_size=1",
        "student.tp=1",
        "reference.tp=1",
    ]
    code, err = _cli_error([_preset("stable_opd"), *overrides], tmp_path)
    assert code != 0 and "does not match the student's" in err and "pick a teacher of the student's family" in err

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": 3}\nnot json\n{"answer": "1"}\n')
    overrides = [o for o in tiny_overrides(tmp_path, student, teacher, "baddata") if not o.startswith("data.sources")]
    code, err = _cli_error(
        [
            _preset("stable_opd"),
            *overrides,
            f"data.sources=[{{path: {bad}}}]",
            "run.world_size=1",
            "student.tp=1",
            "reference.tp=1",
        ],
        tmp_path,
    )
    assert code != 0 and str(bad) in err and "tools/build_tiny_data.py" in err, err[-2000:]
