"""CUDA-graph decode (megaopd.engine.graphs): the batch sizes and length buckets everywhere; on a GPU, the
replayed steps give the eager steps' tokens and log-probs (skipped without CUDA)."""

import pytest
import torch

from megaopd.engine.graphs import default_batch_sizes, length_buckets


def test_batch_sizes_and_buckets():
    assert default_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_batch_sizes(3) == [1, 2, 3]
    assert default_batch_sizes(1) == [1]
    assert length_buckets(1000) == [256, 384, 512, 768, 1000]
    assert length_buckets(1024) == [256, 384, 512, 768, 1024]
    assert length_buckets(256) == [256]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_decode_equals_eager(tiny_dir):
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.engine.rows import RowRequest
    from megaopd.engine.runner import ModelRunner

    rows = [
        RowRequest(
            prompt_ids=[3 + i, 5, 9][: 1 + i % 3], max_new_tokens=5 + 7 * (i % 3), seed=i, stop_ids=frozenset({2})
        )
        for i in range(11)
    ]
    kw = dict(hf_dir=tiny_dir, device="cuda", max_batch_size=4, load_tokenizer=False)
    eager = ModelRunner(EmbeddedEngineConfig(cuda_graph_bs=[], **kw)).run(rows)
    runner = ModelRunner(EmbeddedEngineConfig(**kw))
    graphed = runner.run(rows)
    assert runner._graphs is not None and runner._graphs.off is None and runner._graphs.graphs
    assert [r.output_ids for r in graphed] == [r.output_ids for r in eager]
    for g, e in zip(graphed, eager):
        assert g.logprobs == pytest.approx(e.logprobs, abs=1e-5)
