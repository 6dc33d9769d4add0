"""Faults met when `megaopd train` starts, without training (issue 53): a second trainer on a run folder in use,
refused resumes that must leave the folder as it was (a changed data order, an edited trainer_state.json, a
rank's refusal after the checks), a garbled config.yaml, run.dir a file, a rank's traceback that cannot be
written. Each ends in one line naming the thing and the fix. The end-to-end cases are in
tests/trainer/test_run_folder_faults.py."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from megaopd.models import manifest as mf
from megaopd.trainer import cli
from tests.trainer._procs import start_python
from tests.trainer.tiny_models import ROOT

PRESET = os.path.join(ROOT, "examples", "tiny", "stable_opd.yaml")
TINY = os.path.join(ROOT, "examples", "tiny", "models")
ONE_RANK = ["run.world_size=1", "student.tp=1", "reference.tp=1"]


def _cfg(run_dir, *overrides):
    return load_config(MegaOPDConfig, PRESET, [f"run.dir={run_dir}", *overrides])


def _listing(run):
    """Every path under `run` and its bytes, but the lock file (a start creates it where an older megaopd left
    none; it holds no state of the run)."""
    return sorted(
        (str(p.relative_to(run)), None if p.is_dir() else p.read_bytes()) for p in run.rglob("*") if p.name != cli.LOCK
    )


def _resumable(run, step=3, saved_step=None, seed=1234):
    """A run folder started once (config.yaml, configs/) with a complete step folder at `step` whose
    trainer_state.json records `saved_step` (default: `step`) and the data order of data.seed=`seed`."""
    assert cli._prepare_run_dir(_cfg(run, *ONE_RANK)) == []
    folder = run / "checkpoints" / f"step_{step:06d}"
    (folder / "model").mkdir(parents=True)
    shutil.copy(os.path.join(TINY, "student", "config.json"), folder / "config.json")
    (folder / "model" / "__0_0.distcp").write_bytes(b"\x01" * 256)
    sampler = {"epoch": 0, "position": 12, "seed": seed, "sizes": [500], "weights": [1.0], "shuffle": True}
    state = {"step": step if saved_step is None else saved_step, "data": {"sampler": sampler, "batch_size": 32}}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    mf.write_manifest(str(folder), mf.hash_files(str(folder), mf.list_files(str(folder))), step)
    (run / "checkpoints" / "latest").write_text(folder.name)
    return folder


def _main(run, *overrides):
    return cli.main([PRESET, f"run.dir={run}", *ONE_RANK, *overrides])


def _no_ranks(monkeypatch):
    """run_worker replaced: a start that gets as far as the ranks says so (the checks come before)."""
    started = []

    def worker(rank, world_size, cfg, record=None):
        started.append(rank)
        raise AssertionError("the ranks started")

    monkeypatch.setattr(cli, "run_worker", worker)
    return started


# ---------------------------------------------------------------------------------------------- one run per folder


HOLDER = """
import sys, time
from megaopd.trainer import cli
fd = cli.hold_run_dir(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def _holder(run):
    proc = start_python(["-c", HOLDER, str(run)], stderr=None)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_trainer_on_a_folder_in_use_stops_in_one_line_naming_the_holder_and_writes_nothing(
    tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    _resumable(run)
    proc = _holder(run)
    try:
        before = _listing(run)
        started = _no_ranks(monkeypatch)
        assert _main(run) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"run.dir={run} is in use by another megaopd train" in err, err
        assert f"host {socket.gethostname()}, pid {proc.pid}, since " in err and "UTC" in err, err
        assert started == [] and _listing(run) == before
    finally:
        proc.kill()
        proc.wait()


def test_the_lock_goes_with_its_holder_even_by_sigkill(tmp_path):
    run = tmp_path / "run"
    proc = _holder(run)
    with pytest.raises(cli.RunDirError, match="in use by another megaopd train"):
        cli.hold_run_dir(str(run))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    fd = cli.hold_run_dir(str(run))  # the OS released it: no stale lock
    try:
        assert f"pid {os.getpid()}" in (run / cli.LOCK).read_text()
    finally:
        os.close(fd)


def test_a_finished_start_releases_the_lock(tmp_path, monkeypatch, capsys):
    """The same command run again after the first ended (a resume) is no second trainer."""
    run = tmp_path / "run"
    _no_ranks(monkeypatch)
    assert _main(run) == 1  # the ranks "failed"
    capsys.readouterr()
    os.close(cli.hold_run_dir(str(run)))


def test_run_dir_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    path = tmp_path / "run"
    path.write_text("not a folder")
    started = _no_ranks(monkeypatch)
    assert _main(path) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"megaopd train: run.dir={path} cannot hold the run (a file, not a folder): set run.dir to a folder this "
        f"user can write"
    )
    assert started == [] and path.read_text() == "not a folder"


def test_run_dir_not_writable_is_one_line(tmp_path, monkeypatch, capsys):
    """(Root writes anywhere, so the refusal is simulated: os.access says no.)"""
    run = tmp_path / "run"
    run.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(run) else real(p, mode, **kw))
    _no_ranks(monkeypatch)
    assert _main(run) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"megaopd train: run.dir={run} cannot hold the run (Permission denied): set run.dir to a folder this user "
        f"can write"
    )
    assert os.listdir(run) == []


# ------------------------------------------------------------------------------ a refused resume changes nothing


def test_a_changed_data_seed_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _resumable(run)
    before = _listing(run)
    started = _no_ranks(monkeypatch)
    assert _main(run, "data.seed=99") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "cannot resume" in err and "data.seed 1234 -> 99" in err, err
    assert started == [] and _listing(run) == before


def test_a_changed_source_weight_or_count_is_refused_up_front(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _resumable(run)
    before = _listing(run)
    _no_ranks(monkeypatch)
    two = "data.sources=[{path: examples/tiny/data/opd.jsonl, name: a}, {path: examples/tiny/data/opd.jsonl, name: b}]"
    assert _main(run, two) == 2
    assert "data.sources 1 entries -> 2 entries" in capsys.readouterr().err
    assert _main(run, "data.sources=[{path: examples/tiny/data/opd.jsonl, weight: 2.0}]") == 2
    assert "data.sources[0].weight 1 -> 2" in capsys.readouterr().err
    assert _listing(run) == before


def test_a_checkpoint_of_another_data_order_is_refused_up_front_even_without_config_yaml(tmp_path, monkeypatch, capsys):
    """config.yaml deleted: the change check has nothing to compare, the checkpoint's sampler state still has."""
    run = tmp_path / "run"
    _resumable(run, seed=7)
    (run / "config.yaml").unlink()
    before = _listing(run)
    _no_ranks(monkeypatch)
    assert _main(run) == 2
    err = capsys.readouterr().err
    assert "data order seed 7 (saved) -> 1234" in err, err
    assert _listing(run) == before


def test_trainer_state_step_must_match_the_manifest(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    folder = _resumable(run, step=3, saved_step=999)
    before = _listing(run)
    _no_ranks(monkeypatch)
    assert _main(run) == 2
    err = capsys.readouterr().err
    assert f"{folder}/trainer_state.json records step 999 but its manifest step 3" in err, err
    assert _listing(run) == before


def test_a_resume_refused_by_a_rank_leaves_config_yaml_and_its_history_as_they_were(tmp_path, monkeypatch, capsys):
    """What only a rank can check (the sampler's source sizes, the checkpoint's shapes) fails after the start's
    checks: config.yaml and configs/ are written only once the resume has loaded, so they stay."""
    run = tmp_path / "run"
    _resumable(run)
    before = _listing(run)

    def refuses(rank, world_size, cfg, record=None):
        raise ValueError("data sampler state was saved with sizes=[500] but this run has sizes=[499]")

    monkeypatch.setattr(cli, "run_worker", refuses)
    assert _main(run, "optimizer.lr=1e-2") == 1
    capsys.readouterr()
    assert [entry for entry in _listing(run) if not entry[0].startswith("logs")] == before
    assert "lr: 0.0005" in (run / "config.yaml").read_text()


def test_a_resume_that_loads_records_its_config_and_prints_its_changes(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _resumable(run)

    class Trainer:  # the rank's Trainer after a resume that loaded step 3
        def __init__(self, cfg, preemption=None):
            self.step, self.run_log = 3, None

        def train(self):
            return None

    import types

    monkeypatch.setitem(sys.modules, "megaopd.trainer.trainer", types.SimpleNamespace(Trainer=Trainer))
    assert _main(run, "optimizer.lr=1e-2") == 0
    assert "config changed at step 3: optimizer.lr 0.0005 -> 0.01" in capsys.readouterr().out
    assert "lr: 0.01" in (run / "config.yaml").read_text()
    assert sorted(os.listdir(run / "configs")) == ["step_000000.yaml", "step_000003.yaml"]


def test_a_garbled_config_yaml_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _resumable(run)
    (run / "config.yaml").write_text("run: {dir: [unclosed\n  : : :\n")
    before = _listing(run)
    _no_ranks(monkeypatch)
    assert _main(run) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{run}/config.yaml is not a readable config" in err and "restore it" in err, err
    assert _listing(run) == before


# ------------------------------------------------------------------------------------------ a rank's traceback


def test_a_traceback_that_cannot_be_written_still_ends_in_one_line(tmp_path, monkeypatch, capsys):
    """A full disk fails the save, then the write of rank_R.err: the line still goes out, no second traceback."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "logs").write_text("")  # logs/ cannot be made: as on a full disk, the write fails

    def fails(rank, world_size, cfg, record=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "run_worker", fails)
    assert _main(run) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("megaopd train: rank 0 failed: OSError: [Errno 28] No space left on device"), err
    assert "could not be written" in err


# ------------------------------------------------------------------------------------- a signal during start-up

SPINNING_START = """
import sys, types
from megaopd.trainer import cli

class Trainer:  # a start-up that would run for minutes (a real tokenizer pair's tables, a 7B load)
    def __init__(self, cfg, preemption=None):
        print("starting", flush=True)
        n = 0
        while True:
            n += 1

sys.modules["megaopd.trainer.trainer"] = types.SimpleNamespace(Trainer=Trainer)
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_at_any_moment_of_start_up_exits_within_seconds(tmp_path, sig):
    """Issue 53: the SIGTERM sent during a 23-minute start-up loop was swallowed (the flag was read only by
    the first step). Now the start-up ends where it is: exit 0 (a preempted run), one line, nothing written
    but the lock and config-free folder."""
    run = tmp_path / "run"
    proc = start_python(["-c", SPINNING_START, PRESET, f"run.dir={run}", *ONE_RANK], stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "starting"
        proc.send_signal(sig)
        # the start-up never ends by itself: exiting at all is the signal's doing. The bound is loose for a
        # loaded machine (a few seconds when idle: the interpreter's teardown of torch and megatron included)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert err.strip() == (
        f"megaopd train: preemption signal {sig.name} during start-up: nothing trained since the last "
        f"checkpoint, nothing to save; exiting"
    )
    assert not (run / "config.yaml").exists()


def test_a_model_config_json_that_is_not_json_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    student = tmp_path / "student"
    shutil.copytree(os.path.join(TINY, "student"), student)
    (student / "config.json").write_text('{"hidden_size": 96,,')
    _no_ranks(monkeypatch)
    assert _main(tmp_path / "run", f"student.path={student}") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{student}/config.json is not JSON (JSONDecodeError: " in err, err
    assert not (tmp_path / "run").exists()
