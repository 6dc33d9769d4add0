"""The committed tiny models (examples/tiny/models, built by tools/build_tiny_models.py).

They load in transformers with the sizes their manifest documents and the presets rely on (student heads and
KV groups divisible by TP=2); the teacher solves more of the validation set than the student with the
embedded engine + megaopd.eval; and `tools/build_tiny_models.py --check` passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(ROOT, "examples", "tiny", "models")
VAL = os.path.join(ROOT, "examples", "tiny", "data", "val.jsonl")


def manifest() -> dict:
    with open(os.path.join(MODELS, "manifest.json")) as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("role", ["teacher", "student"])
def test_models_load_with_documented_sizes(role):
    import transformers

    from megaopd.models.hf_io import load_tokenizer

    d = os.path.join(MODELS, role)
    rec = manifest()["models"][role]
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == rec["parameters"]
    spec = manifest()["specs"][role]
    assert (
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
        cfg.vocab_size,
    ) == (spec["hidden"], spec["layers"], spec["heads"], spec["kv_heads"], spec["ffn"], 256)
    assert cfg.num_attention_heads % 2 == 0 and cfg.num_key_value_heads % 2 == 0  # TP=2
    gen = transformers.GenerationConfig.from_pretrained(d)
    assert (gen.eos_token_id, gen.pad_token_id) == (2, 0)
    tok = load_tokenizer(d)
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0 and len(tok) == 256
    assert tok.decode(tok.encode("x = 3\nThe answer")) == "x = 3\nThe answer"
    sizes = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    assert sizes < 8 * 2**20, f"{role} takes {sizes} bytes: keep the committed models to a few MB"


@pytest.mark.slow
def test_teacher_beats_student_on_val_subset():
    import torch

    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.eval.evaluate import EvalConfig, EvalModel, evaluate
    from megaopd.models.hf_io import load_tokenizer
    from megaopd.rollout.embedded import EmbeddedEngine

    torch.set_num_threads(2)
    acc = {}
    for role in ("teacher", "student"):
        d = os.path.join(MODELS, role)
        engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=d, device="cpu"))
        result = evaluate(
            EvalModel(engine, load_tokenizer(d)),
            [VAL],
            EvalConfig(samples=1, temperature=0.6, max_new_tokens=128, limit=64, seed=0),
        )
        acc[role] = result.average
    # 64 problems, the manifest's subset: at 32 one standard error of the difference is ~0.12, and a change of
    # the engine's draws alone moved the margin from above 0.1 to 0.094 (0.50 vs 0.41).
    assert acc["teacher"] > acc["student"] + 0.1, acc
    assert acc["student"] > 0, acc  # OPD needs a student that sometimes gets there


@pytest.mark.slow
def test_build_check_passes():
    """Rebuilds the random inits, reruns a prefix of each SFT and re-evaluates the committed weights."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "build_tiny_models.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "tiny models check passed" in proc.stdout


@pytest.mark.slow
def test_teacher_xtok_has_another_tokenizer_and_its_manifest_sizes():
    """teacher_xtok (tools/build_tiny_models.py --xtok): the teacher's sizes on a 384-id tokenizer whose tokens
    of the same text differ from the tiny tokenizer's; its committed files are its manifest's."""
    import transformers

    from megaopd.models.hf_io import load_tokenizer

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import build_tiny_models as tool

    d = os.path.join(MODELS, "teacher_xtok")
    with open(os.path.join(MODELS, "xtok_manifest.json")) as f:
        rec = json.load(f)
    assert tool.dir_hashes(d) == rec["files"]
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
    assert model.config.vocab_size == 384 and sum(p.numel() for p in model.parameters()) == rec["parameters"]
    teacher = manifest()["specs"]["teacher"]
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (teacher["hidden"], teacher["layers"])
    tok, tiny = load_tokenizer(d), load_tokenizer(os.path.join(MODELS, "teacher"))
    text = "Divide both sides by 8: x = 96 / 8\nThe answer is \\boxed{12}."
    assert tok.decode(tok.encode(text)) == text and tok.encode(text) != tiny.encode(text)
    assert (tok.eos_token_id, tok.pad_token_id) == (tiny.eos_token_id, tiny.pad_token_id) == (2, 0)
    assert rec["val"]["problems"] == 64 and 0 < rec["val"]["accuracy"] <= 1  # quality: examples/tiny/README.md
