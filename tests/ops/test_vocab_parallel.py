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
    results = [_workers.load(p) for p in spawn(_workers.run_all_cases, world_size=world_size, timeout=300)]
    _check(world_size, results)
    if world_size == 4:  # two TP=2 groups side by side in the same job
        for ranks in ([0, 1], [2, 3]):
            errors = []
            for case in _cases.CASES[:2]:
                errors += _cases.compare(
                    case, 2, [results[r]["subgroups"][case.name] for r in ranks], _cases.reference(case, 2)
                )
            assert not errors, f"TP group {ranks}:\n" + "\n".join(errors)
