"""Tiny random Qwen2 student/teacher HF directories with the committed tiny tokenizer (for trainer tests)."""

from __future__ import annotations

import os
import shutil

from megaopd.models.presets import make_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "tiny", "tokenizer")
DATA = os.path.join(ROOT, "examples", "tiny", "data")


def qwen2_config(hidden: int, layers: int, heads: int, kv: int, ffn: int) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 256,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def make_tiny_pair(out_dir: str, seed: int = 0) -> tuple[str, str]:
    """(student_dir, teacher_dir): a 2-layer hidden-64 student and a 2-layer hidden-96 teacher."""
    dirs = []
    for name, cfg in (("student", qwen2_config(64, 2, 4, 2, 128)), ("teacher", qwen2_config(96, 2, 4, 2, 192))):
        d = os.path.join(out_dir, name)
        make_hf_model(cfg, d, seed=seed + len(dirs))
        for f in os.listdir(TOKENIZER):  # replace the preset's word-level tokenizer with the chat one
            shutil.copy(os.path.join(TOKENIZER, f), d)
        dirs.append(d)
    return dirs[0], dirs[1]


def make_tiny_qwen3_pair(out_dir: str, seed: int = 0, student_moe: bool = False) -> tuple[str, str]:
    """(student_dir, teacher_dir): a 2-layer Qwen3 student ('tiny-qwen3': per-head q/k norm, head_dim 32
    apart from hidden/heads; or, with student_moe, a second 'tiny-qwen3-moe') and a 2-layer Qwen3-MoE
    teacher ('tiny-qwen3-moe': 8 experts, top 2), both over the tiny chat tokenizer's 256 ids."""
    from megaopd.models.presets import preset_config

    ids = {
        "vocab_size": 256,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "num_hidden_layers": 2,
        "max_position_embeddings": 512,
    }
    dirs = []
    for name, preset in (("student", "tiny-qwen3-moe" if student_moe else "tiny-qwen3"), ("teacher", "tiny-qwen3-moe")):
        d = os.path.join(out_dir, name)
        make_hf_model({**preset_config(preset), **ids}, d, seed=seed + len(dirs))
        for f in os.listdir(TOKENIZER):  # replace the preset's word-level tokenizer with the chat one
            shutil.copy(os.path.join(TOKENIZER, f), d)
        dirs.append(d)
    return dirs[0], dirs[1]
