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

    from megaopd.batching.packing import PackedRow, Segment, pack_by_budget
    from megaopd.batching.shares import balanced_partition

    row = PackedRow([Segment(0, 2, 3), Segment(1, 0, 2)], total=7)
    assert row.cu_seqlens.tolist() == [0, 3, 5, 7] and row.max_seqlen == 3 and row.num_seqs == 3
    assert row.position_ids().tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert row.seq_ids().tolist() == [[0, 0, 0, 1, 1, 2]]
    x = torch.arange(12.0).reshape(3, 4)
    assert row.per_token(x, 0, -1).tolist() == [[8.0, 9.0, -1, -1, -1, -1]]
    assert row.per_token(x, 1, -1).tolist() == [[-1, -1, -1, 0.0, -1, -1]]
    bins = pack_by_budget([5, 3, 4, 2, 9], 9)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4] and bins == pack_by_budget([5, 3, 4, 2, 9], 9)
    shares = balanced_partition([[8], [1], [1], [6], [2], [2]], 2)
    assert [sum([8, 1, 1, 6, 2, 2][i] for i in s) for s in shares] == [10, 10]


def test_padded_fused_attention_equals_megatrons(one_torch_thread):
    """The CUDA padded path (torch's causal SDPA, KV heads repeated for GQA) computes what megatron's local
    attention computes: forced on here on CPU (float32), Qwen2-shaped GQA (4 query heads, 2 KV groups)."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megaopd.models.packed_attention import PackedDotProductAttention
    from megaopd.parallel.dist import init_distributed
    from megaopd.parallel.groups import Layout, initialize_actor_layout

    init_distributed()
    pgs = initialize_actor_layout(Layout(1, 1))
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        attention_dropout=0.0,
        apply_query_key_layer_scaling=True,
        params_dtype=torch.float32,
    )
    attn = PackedDotProductAttention(
        cfg, layer_number=2, attn_mask_type=AttnMaskType.causal, attention_type="self", pg_collection=pgs
    ).eval()
    g = torch.Generator().manual_seed(0)
    s, b = 11, 3
    q = torch.randn(s, b, 4, 8, generator=g)
    k, v = torch.randn(s, b, 2, 8, generator=g), torch.randn(s, b, 2, 8, generator=g)
    want = attn(q, k, v, None)
    assert not attn._padded_sdpa(q, None, None, None)  # CPU: megatron's own
    got = attn._causal_sdpa(q, k, v)
    assert got.shape == want.shape == (s, b, 32)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("gqa", [False, True])
def test_causal_by_length_equals_each_sequence_alone(one_torch_thread, gqa):
    """The CPU packed path (sequences batched by length, right-padded) equals one causal SDPA per sequence,
    values and the gradients of q, k and v, including empty and one-token sequences and a batch split by
    the score cap."""
    import torch
    import torch.nn.functional as F

    from megaopd.models.packed_attention import causal_by_length, length_batches

    lengths = [23, 1, 0, 2, 17, 5, 9, 30, 29, 24, 3, 0, 11, 10]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    g = torch.Generator().manual_seed(0)
    hq, hk, d = 4, 2 if gqa else 4, 8
    q, k, v = (torch.randn(bounds[-1], h, d, generator=g, dtype=torch.float64).requires_grad_() for h in (hq, hk, hk))
    want = torch.cat(
        [
            F.scaled_dot_product_attention(
                *(x[s:e].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=0.3, enable_gqa=gqa
            ).transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:])
            if e > s
        ]
    )
    upstream = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (q, k, v), upstream)
    # a cap of two 30-token sequences cuts 30, 29 | 24, 23; the last sequence (10, batched with
    # 11 and 9) is padded past the row's end (the index clamped)
    got = causal_by_length(q, k, v, bounds, 0.3, gqa, max_scores=2 * hq * 30 * 30)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert [len(b) for b in length_batches(lengths, max_scores=2 * hq * 30 * 30, heads=hq)][:2] == [2, 2]
    for got_grad, want_grad in zip(torch.autograd.grad(got, (q, k, v), upstream), want_grads):
        torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-12)

    batches = length_batches(lengths, ratio=1.25, max_scores=2 * 30 * 30)
    assert sorted(i for b in batches for i in b) == [i for i, n in enumerate(lengths) if n]
    for b in batches:
        assert lengths[b[0]] == max(lengths[i] for i in b) and lengths[b[0]] <= 1.25 * min(lengths[i] for i in b)
        assert len(b) * lengths[b[0]] ** 2 <= 2 * 30 * 30 or len(b) == 1
    assert [30, 29] == [lengths[i] for i in batches[0]]  # the cap cut 30, 29, 24 after two


def test_causal_by_length_keeps_a_non_finite_sequence_to_itself(one_torch_thread):
    """Padding is zeros, not the neighbouring tokens: a NaN in one sequence leaves the others finite (values
    and gradients), as one attention call per sequence would."""
    import torch

    from megaopd.models.packed_attention import causal_by_length

    bounds = [0, 4, 9]
    q, k, v = (torch.randn(9, 2, 4).requires_grad_() for _ in range(3))
    with torch.no_grad():
        v[4] = float("nan")
    out = causal_by_length(q, k, v, bounds, 0.5, False)
    assert torch.isfinite(out[:4]).all() and torch.isnan(out[4:]).any()
    out[:4].sum().backward()
    assert all(torch.isfinite(x.grad[:4]).all() for x in (q, k, v))  # the NaN sequence's own are NaN, as alone
