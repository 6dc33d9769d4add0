"""Megatron GPTModel == transformers, at TP x PP in {1,2}^2 (and EP in {1,2,4} for the MoE), for Qwen2 (GQA,
QKV bias, theta 1e6, tied and untied, vocab 300: not a multiple of 128*TP), Llama (llama3 RoPE scaling, vocab
100: at TP=2 one whole vocab shard is padding), Qwen3 (per-head q/k RMSNorm, head_dim 32 != hidden 64 / 4
heads, no biases; tied and untied) and Qwen3-MoE (8 experts, top 2 renormalized, head_dim 24, through
megatron's MoE layers and the allgather token dispatcher). Also the weight mapping's gather is bit-exact
(float32, and bfloat16 at TP=2 PP=2; at EP > 1 stage by stage with gather_stage_hf_weights), and actor-layout
checkpoints (TP=2 PP=2; TP=2 EP=2 for the MoE) load at TP=1 PP=1 EP=1. One spawn of 4 gloo workers.

    pytest tests/models/test_parity.py -x
"""

import pytest

from megaopd.parallel.launch import spawn
from tests.models import _workers

TOL = 1e-4  # float32, transformers vs megatron kernels
DENSE = ["tiny-qwen2", "tiny-qwen2-tied", "tiny-llama", "tiny-qwen3", "tiny-qwen3-tied"]


@pytest.fixture(scope="module")
def parity(hf_models, tmp_path_factory):
    from megaopd.models.presets import make_hf_model

    ckpt_root = str(tmp_path_factory.mktemp("ckpt"))
    bf16_dir = str(tmp_path_factory.mktemp("hf_bf16") / "tiny-qwen2-tied")
    make_hf_model("tiny-qwen2-tied", bf16_dir, dtype="bfloat16")
    per_rank = spawn(_workers.parity_all_layouts, world_size=4, args=(hf_models, ckpt_root, bf16_dir), timeout=1500)
    merged = {}
    for res in per_rank:
        for key, value in res.items():
            merged.setdefault(key, []).append(value)
    return merged


def _key(name, tp, pp, ep=1):
    return (name, tp, pp) if ep == 1 else (name, tp, pp, ep)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", _workers.LAYOUTS)
@pytest.mark.parametrize("name", DENSE)
def test_logits_and_logprobs_match_hf(parity, name, tp, pp):
    logits = parity[(name, tp, pp, "logits")]
    logprobs = parity[(name, tp, pp, "logprobs")]
    assert max(logits) < TOL, logits
    assert max(logprobs) < TOL, logprobs


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,ep", _workers.MOE_LAYOUTS)
def test_moe_logits_and_logprobs_match_hf(parity, tp, pp, ep):
    key = _key("tiny-qwen3-moe", tp, pp, ep)
    logits, logprobs = parity[key + ("logits",)], parity[key + ("logprobs",)]
    # every last-stage rank reports (EP and DP ranks compute the same batch here)
    assert len(logits) == 4 // pp
    assert max(logits) < TOL, logits
    assert max(logprobs) < TOL, logprobs


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,ep", _workers.MOE_LAYOUTS)  # the dense layouts are those with ep == 1
@pytest.mark.parametrize("name", DENSE + ["tiny-qwen3-moe"])
def test_gather_hf_weights_is_bit_exact(parity, hf_models, name, tp, pp, ep):
    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.weights import hf_shapes

    key = _key(name, tp, pp, ep)
    if key + ("exported",) not in parity:
        pytest.skip("layout not run for this model")
    for mismatches in parity[key + ("roundtrip_mismatches",)]:
        assert mismatches == []
    # the stages together export every HF tensor, and nothing else
    names = {n for per_rank in parity[key + ("exported",)] for n in per_rank}
    assert names == set(hf_shapes(read_hf_config(hf_models[name]["hf_dir"])))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_workers.CKPT_LAYOUTS))
def test_actor_checkpoint_loads_at_tp1_pp1(parity, name):
    assert max(parity[(name, "ckpt->11", "logits_vs_saved")]) < 1e-6
    assert max(parity[(name, "ckpt->11", "logits_vs_hf")]) < TOL
    tp, pp, _ = _workers.CKPT_LAYOUTS[name]
    assert parity[(name, "ckpt->11", "meta")][0] == (tp, pp, "float32")


@pytest.mark.slow
def test_bfloat16_export_is_bit_exact_at_tp2_pp2(parity):
    assert parity[("bf16", "roundtrip_mismatches")] == [[], [], [], []]
