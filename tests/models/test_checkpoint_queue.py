"""megaopd.models.compat.start_checkpoint_results_queue: megatron's checkpoint-result Manager, started either
way (fork: a machine without CUDA; spawn: megatron's own, kept where CUDA is present), outlives the preemption
signals srun delivers to every process of a step (tests/trainer/test_end_to_end.py runs the whole preemption)."""

import os
import subprocess
import sys

import pytest

from megaopd.parallel.launch import spawn
from tests.models import _workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_forked_manager_outlives_preemption_signals():
    assert spawn(_workers.results_queue_survives_preemption_signals, 1, args=("fork",)) == [{"rank": 0}]


@pytest.mark.slow
def test_a_spawned_manager_outlives_preemption_signals_in_a_fresh_process():
    """A fresh process, as a torchrun rank is: no multiprocessing resource tracker runs yet, and the spawn
    starts one (whose start unblocks SIGTERM) before the Manager."""
    code = "from tests.models._workers import results_queue_survives_preemption_signals as f; print(f(0, 1, 'spawn'))"
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "{'rank': 0}", r.stdout[-2000:] + r.stderr[-3000:]
