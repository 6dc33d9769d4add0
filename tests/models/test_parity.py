"""Megatron GPTModel == transformers, at TP x PP in {1,2}^2, for Qwen2 (GQA, QKV bias, theta 1e6, tied and
untied, vocab 300: not a multiple of 128*TP) and Llama (llama3 RoPE scaling, vocab 100: at TP=2 one whole
vocab shard is padding). Also the weight mapping's gather is bit-exact (float32, and bfloat16 at TP=2 PP=2),
and a TP=2 PP=2 checkpoint loads at TP=1 PP=1. One spawn of 4 gloo workers (~1-2 min on 2 cores).

    pytest tests/models/test_parity.py -x
"""
import pytest

from megaopd.parallel.launch import spawn
from tests.models import _workers

TOL = 1e-4  # float32, transformers vs megatron kernels


@pytest.fixture(scope="module")
def parity(hf_models, tmp_path_factory):
    from megaopd.models.presets import make_hf_model

    ckpt_root = str(tmp_path_factory.mktemp("ckpt"))
    bf16_dir = str(tmp_path_factory.mktemp("hf_bf16") / "tiny-qwen2-tied")
    make_hf_model("tiny-qwen2-tied", bf16_dir, dtype="bfloat16")
    per_rank = spawn(_workers.parity_all_layouts, world_size=4, args=(hf_models, ckpt_root, bf16_dir), timeout=900)
    merged = {}
    for res in per_rank:
        for key, value in res.items():
            merged.setdefault(key, []).append(value)
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", _workers.LAYOUTS)
@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen2-tied", "tiny-llama"])
def test_logits_and_logprobs_match_hf(parity, name, tp, pp):
    logits = parity[(name, tp, pp, "logits")]
    logprobs = parity[(name, tp, pp, "logprobs")]
    assert max(logits) < TOL, logits
    assert max(logprobs) < TOL, logprobs


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", _workers.LAYOUTS)
@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen2-tied", "tiny-llama"])
def test_gather_hf_weights_is_bit_exact(parity, name, tp, pp):
    for mismatches in parity[(name, tp, pp, "roundtrip_mismatches")]:
        assert mismatches == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen2-tied"])
def test_checkpoint_tp2_pp2_loads_at_tp1_pp1(parity, name):
    assert max(parity[(name, "ckpt22->11", "logits_vs_tp2pp2")]) < 1e-6
    assert max(parity[(name, "ckpt22->11", "logits_vs_hf")]) < TOL
    assert parity[(name, "ckpt22->11", "meta")][0] == (2, 2, "float32")


@pytest.mark.slow
def test_bfloat16_export_is_bit_exact_at_tp2_pp2(parity):
    assert parity[("bf16", "roundtrip_mismatches")] == [[], [], [], []]
