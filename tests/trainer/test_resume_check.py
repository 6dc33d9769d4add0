"""Without training: `megaopd train`'s start compares a resume's config with the stored config.yaml before
writing anything (trainer/resume_config.py, trainer/cli.py _prepare_run_dir), and an error raised in a rank
that runs in this process ends in one line naming the rank.
The end-to-end resume (the new lr really used) is tests/trainer/test_resume_config.py."""

import json
import os
import shutil

import pytest

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from megaopd.trainer import cli
from megaopd.trainer.resume_config import config_changes, unappliable
from tests.trainer.tiny_models import ROOT

PRESET = os.path.join(ROOT, "examples", "tiny", "stable_opd.yaml")
TINY = os.path.join(ROOT, "examples", "tiny", "models")


def _cfg(run_dir, *overrides):
    return load_config(MegaOPDConfig, PRESET, [f"run.dir={run_dir}", *overrides])


@pytest.fixture
def resumable(tmp_path, monkeypatch):
    """A run folder started once, whose checkpoint (a folder with the student's config.json) is at step 40.
    The lookup itself (run_folder.planned_resume) is tested below: here it names that folder."""
    run = tmp_path / "run"
    first = _cfg(run)
    assert cli._prepare_run_dir(first) == []
    ckpt = run / "checkpoints" / "step_000040"
    ckpt.mkdir(parents=True)
    shutil.copy(os.path.join(TINY, "student", "config.json"), ckpt / "config.json")
    monkeypatch.setattr(cli, "_resume_point", lambda run_dir: (str(ckpt), 40))
    return run


def _step_folder(run, n):
    """A complete step folder (the student's config.json, a shard, a manifest recording step n)."""
    from megaopd.models import manifest as mf

    step = run / "checkpoints" / f"step_{n:06d}"
    (step / "model").mkdir(parents=True)
    shutil.copy(os.path.join(TINY, "student", "config.json"), step / "config.json")
    (step / "model" / "__0_0.distcp").write_bytes(bytes([n]) * 256)
    mf.write_manifest(str(step), mf.hash_files(str(step), mf.list_files(str(step))), n)
    return step


def _looked_up(run):
    """cli._resume_point of `run`, checking that it changed nothing there (names, sizes, bytes)."""

    def listing():
        return sorted((str(p.relative_to(run)), None if p.is_dir() else p.read_bytes()) for p in run.rglob("*"))

    before = listing()
    found = cli._resume_point(str(run))
    assert listing() == before
    return found


def test_the_resume_point_is_found_without_changing_the_folder(tmp_path):
    """The start's lookup reads what the ranks' resume will load (the pointer's step; without a pointer the
    newest step that verifies) and moves or writes nothing: a refused resume must leave the folder as it was.
    It runs the real lookup (no mock), so a broken import ends this test, not every resume of `megaopd train`
    before step 1."""
    run = tmp_path / "run"
    assert cli._resume_point(str(run)) == (None, 0)
    two, three = _step_folder(run, 2), _step_folder(run, 3)
    (run / "checkpoints" / "latest").write_text("step_000002")
    assert _looked_up(run) == (str(two), 2)
    (run / "checkpoints" / "latest").unlink()
    assert _looked_up(run) == (str(three), 3)
    (three / "model" / "__0_0.distcp").write_bytes(b"\xff" * 256)  # does not verify: the one before does
    assert _looked_up(run) == (str(two), 2)


def test_a_start_over_compares_nothing(tmp_path):
    """run.start_over=true starts at step 0 (the old steps are moved aside by the ranks): another model is no
    refusal, and the config of that start is kept as step 0's."""
    run = tmp_path / "run"
    assert cli._prepare_run_dir(_cfg(run)) == []
    _step_folder(run, 2)
    (run / "checkpoints" / "latest").write_text("step_000002")
    teacher = os.path.join(TINY, "teacher")
    with pytest.raises(ValueError, match="cannot resume"):
        cli._prepare_run_dir(_cfg(run, f"student.path={teacher}"))
    assert cli._prepare_run_dir(_cfg(run, f"student.path={teacher}", "run.start_over=true")) == []
    assert sorted(os.listdir(run / "configs")) == ["step_000000.1.yaml", "step_000000.yaml"]


def test_applicable_changes_are_listed_one_line_each_and_kept(resumable):
    lines = cli._prepare_run_dir(
        _cfg(
            resumable,
            "optimizer.lr=1e-2",
            "trainer.max_steps=80",
            "loss.config.sft_weight=0.2",
            "rollout.top_p=0.9",
            "student.tp=1",
            "reference.tp=1",
        )
    )
    assert sorted(lines) == sorted(
        [
            "config changed at step 40: optimizer.lr 0.0005 -> 0.01",
            "config changed at step 40: trainer.max_steps 40 -> 80",
            "config changed at step 40: loss.config.sft_weight 0.1 -> 0.2",
            "config changed at step 40: rollout.top_p 1 -> 0.9",
            "config changed at step 40: student.tp 2 -> 1",  # the plain optimizer's checkpoint reshards
            "config changed at step 40: reference.tp 2 -> 1",
        ]
    )
    assert "lr: 0.01" in (resumable / "config.yaml").read_text()
    assert sorted(os.listdir(resumable / "configs")) == ["step_000000.yaml", "step_000040.yaml"]
    # the same start again: nothing new to keep; another config at the same step: kept beside it
    cli._prepare_run_dir(
        _cfg(
            resumable,
            "optimizer.lr=1e-2",
            "trainer.max_steps=80",
            "loss.config.sft_weight=0.2",
            "rollout.top_p=0.9",
            "student.tp=1",
            "reference.tp=1",
        )
    )
    cli._prepare_run_dir(_cfg(resumable, "optimizer.lr=2e-2"))
    # the same folder named absolutely is no change
    assert cli._prepare_run_dir(_cfg(resumable, "optimizer.lr=2e-2", f"student.path={TINY}/student")) == []
    assert sorted(os.listdir(resumable / "configs")) == [
        "step_000000.yaml",
        "step_000040.1.yaml",
        "step_000040.2.yaml",
        "step_000040.yaml",
    ]


@pytest.mark.parametrize(
    "overrides, named",
    [
        (
            [f"student.path={TINY}/teacher"],
            f"student.path examples/tiny/models/student -> {TINY}/teacher; "
            f"{TINY}/teacher/config.json hidden_size 96 -> 128; {TINY}/teacher/config.json "
            f"intermediate_size 256 -> 384; {TINY}/teacher/config.json num_hidden_layers 3 -> 4",
        ),
        (["student.dtype=bfloat16"], "student.dtype float32 -> bfloat16"),
        ([f"teacher.path={TINY}/student"], f"teachers[0].path examples/tiny/models/teacher -> {TINY}/student:"),
        (["loss.controller=adaptive"], "loss.controller fixed -> adaptive"),
        (["optimizer.use_distributed_optimizer=true"], "optimizer.use_distributed_optimizer False -> True"),
    ],
)
def test_changes_the_checkpoint_cannot_take_are_refused_before_anything_is_written(resumable, overrides, named):
    before = (resumable / "config.yaml").read_text()
    with pytest.raises(ValueError) as e:
        cli._prepare_run_dir(_cfg(resumable, *overrides))
    msg = str(e.value)
    assert msg.startswith(f"cannot resume {resumable} (checkpoint at step 40) with {named}") and "\n" not in msg
    assert msg.endswith(
        "start a new run.dir (e.g. student.path=CHECKPOINT to start from its weights), or revert these keys to resume"
    )
    assert (resumable / "config.yaml").read_text() == before
    assert os.listdir(resumable / "configs") == ["step_000000.yaml"]


def test_layout_changes_are_refused_with_the_distributed_optimizer(tmp_path):
    old = json.loads(json.dumps({"student": {"tp": 2}, "optimizer": {"use_distributed_optimizer": True}}))
    new = {"student": {"tp": 1}, "optimizer": {"use_distributed_optimizer": True}}
    cfg = _cfg(tmp_path, "optimizer.use_distributed_optimizer=true")
    assert unappliable(config_changes(old, new), cfg, str(tmp_path)) == ["student.tp 2 -> 1"]
    cfg = _cfg(tmp_path)
    assert unappliable(
        config_changes(old, {**new, "optimizer": {"use_distributed_optimizer": False}}), cfg, str(tmp_path)
    ) == ["optimizer.use_distributed_optimizer True -> False"]


def test_an_error_in_an_in_process_rank_is_one_line(tmp_path, monkeypatch, capsys):
    def fails(rank, world_size, cfg, record=None):
        raise ValueError("a check that only a rank can make failed: fix X")

    monkeypatch.setattr(cli, "run_worker", fails)
    run = tmp_path / "run"
    assert cli.main([PRESET, f"run.dir={run}", "run.world_size=1", "student.tp=1", "reference.tp=1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"megaopd train: rank 0 failed: ValueError: a check that only a rank can make failed: fix X "
        f"(traceback: {run}/logs/rank_0.err)"
    )
    assert "Traceback" in (run / "logs" / "rank_0.err").read_text()
