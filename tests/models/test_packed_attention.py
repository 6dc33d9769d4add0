"""Packed sequences (THD, cu_seqlens) through megaopd's core attention == each sequence run alone.

Sequences of very uneven lengths (1 to 23 tokens) packed end to end in one row, plus a padding segment;
the logits of every sequence equal those of the sequence run alone (the padded path, megatron's own
attention) within float32 tolerance, at TP=1, TP=2 and PP=2: attention stays inside each sequence and
RoPE positions restart at 0 in each. Qwen2 (GQA, QKV bias) and Qwen3 (per-head q/k norm). One spawn of
4 gloo workers.

    pytest tests/models/test_packed_attention.py -x
"""
import pytest

from megaopd.parallel.launch import spawn
from tests.models import _workers

TOL = 2e-5  # float32: SDPA per sequence vs megatron's baddbmm/softmax
LENGTHS = [23, 1, 2, 17, 5, 9]


@pytest.fixture(scope="module")
def packed(hf_models):
    models = {n: hf_models[n] for n in ("tiny-qwen2", "tiny-qwen3")}
    per_rank = spawn(_workers.packed_vs_alone, world_size=4, args=(models, LENGTHS), timeout=900)
    merged = {}
    for res in per_rank:
        for key, value in res.items():
            merged.setdefault(key, []).append(value)
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", _workers.PACKED_LAYOUTS)
@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3"])
def test_packed_logits_equal_each_sequence_alone(packed, name, tp, pp):
    diffs = packed[(name, tp, pp)]
    assert diffs and max(diffs) < TOL, diffs
    print(name, tp, pp, max(diffs))


def test_packed_row_layout():
    import torch

    from megaopd.scoring.packing import PackedRow, Segment, balanced_partition, pack_by_budget

    row = PackedRow([Segment(0, 2, 3), Segment(1, 0, 2)], total=7)
    assert row.cu_seqlens.tolist() == [0, 3, 5, 7] and row.max_seqlen == 3 and row.num_seqs == 3
    assert row.position_ids().tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert row.seq_ids().tolist() == [[0, 0, 0, 1, 1, 2]]
    x = torch.arange(12.).reshape(3, 4)
    assert row.per_token(x, 0, -1).tolist() == [[8., 9., -1, -1, -1, -1]]
    assert row.per_token(x, 1, -1).tolist() == [[-1, -1, -1, 0., -1, -1]]
    bins = pack_by_budget([5, 3, 4, 2, 9], 9)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4] and bins == pack_by_budget([5, 3, 4, 2, 9], 9)
    shares = balanced_partition([[8], [1], [1], [6], [2], [2]], 2)
    assert [sum([8, 1, 1, 6, 2, 2][i] for i in s) for s in shares] == [10, 10]
