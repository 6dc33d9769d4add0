"""Rank 0's rollout reaches each rank as tensors, only the rows it trains or scores (batching.delivery): a
4-process gloo job with the actor at DP=2 TP=2 and a teacher at DP=4 scoring some rows
in its own layout. Every rank gets every row's header (lengths, finish reasons, trajectory counts); each
rank's held rows are exactly its replica's owned rows plus the rows its teacher replica scores, bit for bit
rank 0's (ids above 2^16, float log-probs, a trajectory's environment tokens masked); the other rows stay
padding, a read of them is refused, and the bytes received are the held rows' real tokens, 12 bytes each;
a record rank 0 fails to build raises on every rank."""

import pytest

from megaopd.parallel.launch import spawn
from tests.batching import _delivery_workers as w


@pytest.mark.slow
def test_each_rank_receives_the_rows_it_trains_or_scores_and_only_those():
    results = spawn(w.deliver, 4, timeout=300)
    for rank, r in enumerate(results):
        assert r["header"], rank
        # A record rank 0 cannot build fails every rank at once, instead of leaving the others waiting.
        assert r["failed"] == (
            "ValueError: sample 3: output_mask does not match"
            if rank == 0
            else "RuntimeError: rank 0 could not build the step's rollout record from the engines' "
            "samples: its error is in rank 0's log"
        )
        if rank == 0:
            assert r["held"] == list(range(8)) and r["received_bytes"] == 0 and r["refused"] is None
            continue
        owned = [b for b, o in enumerate(w.OWNER) if o == rank // 2]
        assert r["held"] == sorted(set(owned) | set(w.SHARES[rank])), rank
        assert r["tokens"] and r["mask"] and r["logprobs"] and r["others_empty"], (rank, r)
        assert r["refused"] is not None and "not delivered to this rank" in r["refused"]
        assert r["received_bytes"] == 12 * sum(r["real_tokens"][b] for b in r["held"]), rank
