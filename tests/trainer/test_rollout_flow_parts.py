"""RolloutFlow.parts (rollout.stream_parts in sync mode, megaopd.trainer.rollout_stage): each part of the
batch is handed on once, as a RolloutPart with its batch rows, in the order the engine returns them (the parts
that came back while the last was scored, together), so they make up the whole batch; a batch too small to split
comes back as one part; a part whose generation fails raises its error (on every rank: it is broadcast) instead
of leaving the loop waiting. A fake engine in one gloo process."""

import pytest

from megaopd.parallel.launch import spawn
from tests.trainer import _stream_workers as w


def _expected(prompts):
    return [[100 + i, j] for i in range(prompts) for j in range(2)]


@pytest.mark.slow
def test_parts_arrive_once_each_with_their_rows_and_the_whole_batch_after():
    out = spawn(w.stream, 1, args=(7, None), timeout=120)[0]
    assert out["streams"]
    assert [rows for rows, _ in out["parts"]] == [[12, 13], [6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5]]
    for rows, samples in out["parts"]:
        assert samples == [_expected(7)[r] for r in rows]
    assert out["all"] == _expected(7) and out["versions"] == [0] * 14


@pytest.mark.slow
def test_parts_that_arrive_while_the_last_is_scored_come_as_one():
    out = spawn(w.stream, 1, args=(7, None, 1.5), timeout=120)[0]
    assert [rows for rows, _ in out["parts"]] == [[12, 13], [6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5]]
    for rows, samples in out["parts"]:
        assert samples == [_expected(7)[r] for r in rows]
    assert out["all"] == _expected(7)


@pytest.mark.slow
def test_a_batch_too_small_to_split_is_one_part():
    out = spawn(w.stream, 1, args=(1, None), timeout=120)[0]
    assert [rows for rows, _ in out["parts"]] == [[0, 1]] and out["all"] == _expected(1)


@pytest.mark.slow
def test_a_failed_part_raises_its_error():
    out = spawn(w.stream, 1, args=(7, 3), timeout=120)[0]
    assert "engine failed on the part at prompt 3" in out["error"]
