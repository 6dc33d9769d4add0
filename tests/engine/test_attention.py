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
    k, v = cache[:A, :, :L], cache[2:, :, 3 : L + 3]  # strided views of a slot cache, as decode reads them
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


def _sliding_models(tmp_path):
    """A Qwen2 with sliding and full layers (layer_types) and a Mistral sliding in every layer (no layer_types),
    windows of 8 tokens: shorter than the rows below, so a lost window shows."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kw = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=8,
    )
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, max_window_layers=1, **kw))
    mistral = MistralForCausalLM(MistralConfig(**kw))
    assert len(set(qwen.config.layer_types)) == 2 and not getattr(mistral.config, "layer_types", None)
    dirs = []
    for name, model in (("qwen2_sliding", qwen), ("mistral", mistral)):
        model.save_pretrained(str(tmp_path / name))
        dirs.append(str(tmp_path / name))
    return dirs


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sliding_windows_and_eager_masks_match_hf(tmp_path, attn):
    """Decode (packed rows, continuous batching) and prompt scoring (a call without the engine's masks) keep
    every layer's window, with the engine's attention and with transformers' eager one (additive masks)."""
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.engine.rows import RowRequest
    from megaopd.engine.runner import ModelRunner
    from tests.engine._models import hf_logprobs

    rows = [RowRequest(prompt_ids=[3, 4, 5 + i] * (i + 2), max_new_tokens=12 + 3 * i, seed=i) for i in range(4)]
    prompt = list(range(1, 40))
    for d in _sliding_models(tmp_path):
        engine = ModelRunner(
            EmbeddedEngineConfig(hf_dir=d, max_batch_size=3, load_tokenizer=False, attn_implementation=attn)
        )
        for r, out in zip(rows, engine.run(rows)):
            ref = hf_logprobs(d, list(r.prompt_ids), out.output_ids, 1.0)
            assert (ref - torch.tensor(out.logprobs, dtype=torch.float64)).abs().max() < 1e-5, d
        ref = hf_logprobs(d, prompt[:1], prompt[1:], 1.0)
        got = torch.tensor(engine.prompt_logprobs(prompt)[1:], dtype=torch.float64)
        assert (ref - got).abs().max() < 1e-5, d


def test_layer_windows_follow_the_models_own_masks():
    """Without layer_types a model slides where its own code does: Mistral with a window, not Llama with a
    stray sliding_window in its config, nor Qwen2 with use_sliding_window=False."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from megaopd.engine.forward import layer_windows

    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    llama_cfg = LlamaConfig(**kw)
    llama_cfg.sliding_window = 8
    assert layer_windows(LlamaForCausalLM(llama_cfg)) == {"full_attention": None}
    assert layer_windows(MistralForCausalLM(MistralConfig(sliding_window=8, **kw))) == {"sliding_attention": 8}
    assert layer_windows(MistralForCausalLM(MistralConfig(sliding_window=None, **kw))) == {"full_attention": None}
    assert layer_windows(Qwen2ForCausalLM(Qwen2Config(sliding_window=8, use_sliding_window=False, **kw))) == {
        "full_attention": None
    }


def test_only_sdpa_or_eager(tiny_dir):
    from megaopd.engine.config import EmbeddedEngineConfig

    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2': choose sdpa or eager"):
        EmbeddedEngineConfig(hf_dir=tiny_dir, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match=r"admit_min=9 must be in \[0, max_batch_size=8\]"):
        EmbeddedEngineConfig(hf_dir=tiny_dir, max_batch_size=8, admit_min=9)
