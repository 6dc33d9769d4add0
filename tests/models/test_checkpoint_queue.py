"""megaopd.models.compat.start_checkpoint_results_queue: megatron's checkpoint-result Manager, started either
way (fork: a machine without CUDA; spawn: megatron's own, kept where CUDA is present), outlives the preemption
signals srun delivers to every process of a step (tests/trainer/test_end_to_end.py runs the whole preemption)."""
import pytest

from megaopd.parallel.launch import spawn
from tests.models import _workers


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])  # spawn: ~10 s
def test_the_manager_outlives_preemption_signals(method):
    assert spawn(_workers.results_queue_survives_preemption_signals, 1, args=(method,)) == [{"rank": 0}]
