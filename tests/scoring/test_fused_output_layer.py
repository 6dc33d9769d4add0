"""The fused output layer (trainer.logits_chunk_tokens > 0: logits a chunk of tokens at a time, megaopd.ops.head)
gives the model's own output layer's numbers through the pipeline runner: Stable-OPD gradients of every
parameter (DDP main_grad; tied and untied embeddings) and every score of a scoring pass (padded and packed
rows), at TP=1 and TP=2 (gloo). The op-level float64 checks are tests/ops/test_head.py."""

import pytest

from megaopd.parallel.launch import spawn
from tests.scoring import _fused_workers

REL = 2e-5  # float32: the chunked path only changes the order of some sums


@pytest.mark.slow
@pytest.mark.parametrize("world_size,tied", [(1, True), (2, False)])
def test_chunked_equals_whole_logits(world_size, tied):
    for rank, diffs in enumerate(spawn(_fused_workers.compare, world_size, args=(tied,), timeout=300)):
        bad = {k: v for k, v in diffs.items() if v > REL}
        assert not bad, (rank, bad)
