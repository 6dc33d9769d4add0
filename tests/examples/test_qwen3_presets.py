"""examples/qwen3 presets pass start-up validation against config.json files with the released models' sizes
(Qwen3-8B-Base, Qwen3-32B, Qwen3-30B-A3B; public config.json values): TP divides heads and KV groups, the
MoE teacher's EP=8 divides its 128 experts and the data-parallel size. Keys that branch h-cluster adds to the
schema (recompute, sequence_parallel, plan) are dropped before loading here."""
import json
import os

import pytest
import yaml

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from tests.examples.test_tiny_models import ROOT

# Only the fields validation reads (huggingface.co/Qwen/<name>/blob/main/config.json).
DIMS = {
    "Qwen3-8B-Base": dict(architectures=["Qwen3ForCausalLM"], num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=151936),
    "Qwen3-32B": dict(architectures=["Qwen3ForCausalLM"], num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=151936),
    "Qwen3-30B-A3B": dict(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, vocab_size=151936, num_experts=128),
}
LATER_KEYS = {"recompute", "sequence_parallel"}


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
    raw.pop("plan")
    for role in ("student", "reference", "teacher"):
        raw[role] = {k: v for k, v in raw[role].items() if k not in LATER_KEYS}
    raw["validation"]["path"] = ""
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump(raw))
    cfg = load_config(MegaOPDConfig, str(preset), [])
    assert cfg.run.world_size == 8 and cfg.student.tp == 2
    assert (cfg.teacher.tp, cfg.teacher.ep) == ((1, 8) if name.endswith("moe_teacher") else (4, 1))
