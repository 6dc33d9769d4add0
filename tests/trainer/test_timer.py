"""trainer/timer.py: named, nested phase timings; max over ranks; the StepTimes record and the names it logs."""

import time

import pytest
import torch

from megaopd.trainer.step_metrics import StepTimes
from megaopd.trainer.timer import Timer


def test_nested_names_are_flat_metrics_in_closing_order():
    timer = Timer()
    with timer("step"):
        with timer("rollout"):
            time.sleep(0.01)
        with timer("train"):
            pass
        with timer("train"):  # a name's blocks add up
            time.sleep(0.01)
        timer.add("teacher_remote", 0.5)
    got = timer.reduce(None, torch.device("cpu"))
    assert list(got) == ["rollout", "train", "teacher_remote", "step"]
    assert got["rollout"] >= 0.01 and got["train"] >= 0.01 and got["teacher_remote"] == 0.5
    assert got["step"] >= got["rollout"] + got["train"]
    times = StepTimes(**got)  # the step's record; the run log's names
    assert list(times.log()) == ["time/rollout", "time/teacher_remote", "time/train", "time/step"]
    assert times.step == got["step"] and times.sync is None
    assert timer.reduce(None, torch.device("cpu")) == {}  # reduce starts the next step afresh


def test_misuse_is_refused():
    timer = Timer()
    with timer("step"), pytest.raises(ValueError, match="already running"):
        with timer("step"):
            pass
    with timer("step"), pytest.raises(ValueError, match="still running"):
        timer.reduce(None, torch.device("cpu"))


def _reduced(rank, world_size):
    import torch.distributed as dist

    timer = Timer()
    timer.add("rollout", 1.0 + rank)
    timer.add("teacher_remote", 2.0 if rank == 0 else 0.0)  # measured on rank 0 only
    return timer.reduce(dist.group.WORLD, torch.device("cpu"))


def test_reduce_takes_the_slowest_rank():
    from megaopd.parallel.launch import spawn

    results = spawn(_reduced, 2, timeout=120)
    assert results == [{"rollout": 2.0, "teacher_remote": 2.0}] * 2
