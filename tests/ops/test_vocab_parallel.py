"""megaopd.ops against a float64 full-vocabulary reference, at TP=1 (group=None, in-process) and at
TP=2 / TP=4 (gloo workers, one spawn per world size running every case). Values, gradients of both
logits, top-k ids including ties across shards, masked supports; see tests/ops/_cases.py.

    pytest tests/ops -x            # add -m "not slow" to skip the spawned TP=2/4 runs
"""
import pytest

from megaopd.parallel.launch import spawn
from tests.ops import _cases, _workers


def _check(world_size, results_by_rank):
    errors = []
    for case in _cases.CASES:
        ref = _cases.reference(case, world_size)
        errors += _cases.compare(case, world_size, [r[case.name] for r in results_by_rank], ref)
    assert not errors, "\n".join(errors)


def test_tp1_matches_float64_reference():
    results = {case.name: _cases.run_case(case, 0, 1, None) for case in _cases.CASES}
    _check(1, [results])


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_sharded_matches_float64_reference(world_size):
    payloads = spawn(_workers.run_all_cases, world_size=world_size, timeout=300)
    _check(world_size, [_workers.load(p) for p in payloads])
