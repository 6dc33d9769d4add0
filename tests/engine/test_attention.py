"""The engine's attention (megaopd.engine.attention): a decode step's queries packed onto the KV heads give the
attention of every query head over its own KV head, in float64 against the formula with the keys repeated;
everything else is transformers' SDPA as it is; the runner's model uses it."""
import math
import types

import pytest
import torch

from megaopd.engine.attention import ATTENTION, engine_attention


def _reference(q, k, v, mask, scale):
    """softmax(q K^T scale, masked) V with each KV head repeated for its G query heads (repeat_kv)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = q @ k.transpose(-1, -2) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads", [(12, 2), (4, 2), (4, 4)])
def test_packed_decode_equals_repeated_keys(heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    A, L, D = 5, 37, 16
    q = torch.randn(A, heads, 1, D, generator=g, dtype=torch.float64)
    cache = torch.randn(A + 2, kv_heads, L + 20, D, generator=g, dtype=torch.float64)
    k, v = cache[:A, :, :L], cache[2:, :, 3:L + 3]  # strided views of a slot cache, as decode reads them
    lengths = torch.tensor([1, 5, 37, 20, 9])
    mask = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    out, weights = engine_attention(module, q, k, v, mask, scaling=1 / math.sqrt(D))
    assert weights is None and out.shape == (A, 1, heads, D)
    torch.testing.assert_close(out, _reference(q, k, v, mask, 1 / math.sqrt(D)), rtol=1e-12, atol=1e-12)


def test_other_calls_go_to_transformers_sdpa(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa

    seen = []
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **kw: seen.append(a[1].shape) or ("hf", None))
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)
    q1, q3 = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 3, 8)
    kv = torch.zeros(2, 2, 6, 8)
    assert engine_attention(module, q3, kv, kv, None)[0] == "hf"  # prefill: several queries
    per_head = torch.ones(2, 4, 1, 6, dtype=torch.bool)
    assert engine_attention(module, q1, kv, kv, per_head)[0] == "hf"  # a mask that differs by head
    assert seen == [q3.shape, q1.shape]


def test_runner_loads_the_model_with_it(engine):
    assert engine.model.config._attn_implementation == ATTENTION
