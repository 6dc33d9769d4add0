"""A worker's exception reaches the caller as a WorkerError that names the rank and carries the exception in
one line (what `megaopd train` prints) and the traceback apart (what it writes to RUN/logs), so the terminal
shows the message, not a 30-110 line double traceback with the message on its last line."""

import pytest
import torch

from megaopd.parallel.launch import WorkerError, one_line, spawn
from tests.parallel import _workers

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="workers are spawned fresh where CUDA is present")


def test_worker_error_has_the_rank_one_line_and_the_traceback():
    with pytest.raises(WorkerError) as e:
        spawn(_workers.raise_in_rank_one, 2)
    assert e.value.rank == 1
    assert e.value.summary == "ValueError: rank one fails on purpose"
    assert e.value.details.startswith("Traceback") and "raise_in_rank_one" in e.value.details


def test_one_line_joins_a_messages_lines():
    assert one_line(ValueError("first\n  second")) == "ValueError: first second"


def _raised(exc):
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - with its traceback, as DCP wraps it
        return e


def test_one_line_unwraps_a_checkpoint_exception_to_the_first_ranks_error():
    """Issue 53: a failed DCP load printed a 1.7-2.5 KB line holding both ranks' tracebacks."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    failures = {
        1: _wrap_exception(_raised(ValueError("rank one's own"))),
        0: _wrap_exception(_raised(RuntimeError("size mismatch for decoder.layers.0.mlp: [8, 64] vs [16, 64]"))),
    }
    wrapped = CheckpointException("load failed", failures)
    assert len(str(wrapped)) > 200 and "Traceback" in str(wrapped)
    line = one_line(wrapped)
    assert line == "RuntimeError: size mismatch for decoder.layers.0.mlp: [8, 64] vs [16, 64] (checkpoint ranks [0, 1])"
    nested = CheckpointException("save failed", {0: _wrap_exception(_raised(wrapped))})
    assert one_line(nested).startswith("RuntimeError: size mismatch") and "Traceback" not in one_line(nested)


def test_an_in_process_rank_failing_with_a_checkpoint_exception_is_one_line(tmp_path, monkeypatch, capsys):
    """CheckpointException is a BaseException: the in-process rank's `except Exception` let its traceback through."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from megaopd.trainer import cli
    from tests.trainer.tiny_models import ROOT

    def fails(rank, world_size, cfg, record=None):
        raise CheckpointException("load", {0: _wrap_exception(_raised(ValueError("shapes differ: fix X")))})

    monkeypatch.setattr(cli, "run_worker", fails)
    run = tmp_path / "run"
    preset = f"{ROOT}/examples/tiny/stable_opd.yaml"
    assert cli.main([preset, f"run.dir={run}", "run.world_size=1", "student.tp=1", "reference.tp=1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"megaopd train: rank 0 failed: ValueError: shapes differ: fix X (checkpoint ranks [0]) "
        f"(traceback: {run}/logs/rank_0.err)"
    )
