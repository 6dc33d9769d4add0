"""examples/qwen3 presets pass start-up validation against config.json files with the released models' sizes
(Qwen3-8B-Base, Qwen3-32B, Qwen3-30B-A3B; public config.json values): TP divides heads and KV groups, the
MoE teacher's EP=8 divides its 128 experts and the data-parallel size; `megaopd plan` counts the MoE
teacher's experts per EP rank (16 of 128 per layer: 5.17B parameters per GPU, by hand)."""

import json
import os

import pytest
import yaml

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from tests.examples.test_tiny_models import ROOT

# Only the fields validation reads (huggingface.co/Qwen/<name>/blob/main/config.json).
_COMMON = dict(
    head_dim=128,
    vocab_size=151936,
    rms_norm_eps=1e-6,
    rope_theta=1000000,
    tie_word_embeddings=False,
    attention_bias=False,
    hidden_act="silu",
)
DIMS = {
    "Qwen3-8B-Base": dict(
        _COMMON,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        num_hidden_layers=36,
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768,
    ),
    "Qwen3-32B": dict(
        _COMMON,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        num_hidden_layers=64,
        hidden_size=5120,
        intermediate_size=25600,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=40960,
    ),
    "Qwen3-30B-A3B": dict(
        _COMMON,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_hidden_layers=48,
        hidden_size=2048,
        intermediate_size=6144,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=40960,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
}


@pytest.mark.parametrize("name", ["stable_opd_qwen3_8b", "stable_opd_qwen3_8b_moe_teacher"])
def test_qwen3_preset_validates(tmp_path, monkeypatch, name):
    for model, dims in DIMS.items():
        os.makedirs(tmp_path / model)
        (tmp_path / model / "config.json").write_text(json.dumps(dims))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2", "golden": "1+1=2. \\boxed{2}"}) + "\n")
    monkeypatch.setenv("MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("TRAIN_DATA", str(data))
    with open(os.path.join(ROOT, "examples", "qwen3", f"{name}.yaml")) as f:
        raw = yaml.safe_load(f)
    raw["validation"]["path"] = ""
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump(raw))
    cfg = load_config(MegaOPDConfig, str(preset), [])
    assert cfg.run.world_size == 8 and cfg.student.tp == 2
    assert (cfg.teachers[0].tp, cfg.teachers[0].ep) == ((1, 8) if name.endswith("moe_teacher") else (4, 1))
    if name.endswith("moe_teacher"):
        from megaopd.config.plan import plan_for

        teacher = [i for i in plan_for(cfg).items if i.name.startswith("teacher weights")][0]
        assert teacher.score / 2 == pytest.approx(5.17e9, rel=0.01)  # bf16 bytes / 2 = parameters per GPU
