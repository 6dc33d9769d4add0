"""megaopd.parallel.launch.spawn: how local workers start (forked from a forkserver that imported the heavy
modules once, on a machine without CUDA; spawned fresh where import-time variables differ from the server's or
signals are forwarded), that each sees the caller's environment as of the call, and that a worker's exception
reaches the caller."""

import os
import signal
import time

import pytest
import torch

from megaopd.parallel import launch
from megaopd.parallel.launch import WorkerError, spawn
from tests.parallel import _workers

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="workers are spawned fresh where CUDA is present")


def test_workers_fork_from_the_server_and_see_the_callers_environment(monkeypatch):
    monkeypatch.delenv("MEGAOPD_START_METHOD", raising=False)
    monkeypatch.delenv("MEGAOPD_TEST_VAR", raising=False)
    assert spawn(_workers.start_facts, 2) == [("forkserver", None, 1.0)] * 2
    monkeypatch.setenv("MEGAOPD_TEST_VAR", "set after the server started")
    t0 = time.monotonic()
    assert spawn(_workers.start_facts, 2) == [("forkserver", "set after the server started", 1.0)] * 2
    assert time.monotonic() - t0 < 8, "a second start re-imported the heavy modules"
    assert spawn(_workers.start_facts, 1, env={"MEGAOPD_TEST_VAR": "from env"}) == [("forkserver", "from env", 0.0)]


def test_import_time_variables_forwarded_signals_and_the_override_start_fresh(monkeypatch):
    monkeypatch.delenv("MEGAOPD_START_METHOD", raising=False)
    spawn(_workers.start_facts, 1)  # the server runs (started here or by an earlier test)
    env = dict(os.environ)
    assert launch._context(env, ()).get_start_method() == "forkserver"
    assert spawn(_workers.start_facts, 1, env={"TRITON_INTERPRET": "1"})[0][0] == "spawn"
    assert launch._context({**env, "OMP_NUM_THREADS": "7"}, ()).get_start_method() == "spawn"
    # what megaopd's CLI and inductor set in the process mid-session is not read at import
    later = {**env, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}
    assert launch._context(later, ()).get_start_method() == "forkserver"
    assert launch._context(env, (signal.SIGTERM,)).get_start_method() == "spawn"
    monkeypatch.setenv("MEGAOPD_START_METHOD", "spawn")
    assert launch._context(env, ()).get_start_method() == "spawn"


def test_a_workers_exception_names_its_rank():
    with pytest.raises(WorkerError, match="rank 1:(.|\n)*rank one fails on purpose"):
        spawn(_workers.raise_in_rank_one, 2)


def test_a_spawned_worker_leaves_without_teardown_but_runs_its_exit_handlers(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGAOPD_START_METHOD", "spawn")
    assert spawn(_workers.leaves_work_for_exit, 2, args=(str(tmp_path),)) == [0, 1]
    assert sorted(os.listdir(tmp_path)) == ["atexit_0", "atexit_1", "thread_0", "thread_1"]
