import pytest

from megaopd.parallel.launch import spawn
from tests.parallel import _workers


@pytest.mark.slow
def test_teacher_tp2_beside_actor_tp1_matches_single_layout():
    diffs = spawn(_workers.actor_tp1_teacher_tp2, world_size=2)
    assert max(diffs) < 1e-5, diffs


@pytest.mark.slow
def test_teacher_reads_no_global_parallel_state():
    diffs = spawn(_workers.teacher_reads_no_global_state, world_size=2)
    assert max(diffs) < 1e-5, diffs
