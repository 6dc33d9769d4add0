"""Random Qwen2.5-shaped HF models and a tokenizer, built locally (no download) for the GPU check.

    cfg = hf_config_dict("qwen2.5-1.5b", vocab_size=151936)          # config.json fields
    model = random_hf_model(cfg, device, torch.float32)               # in memory, on the device
    write_hf_dir(out_dir, "qwen2.5-0.5b", vocab_size=151936, ...)     # safetensors + config + tokenizer

Shapes are the released models' (hidden, FFN, layers, heads, KV heads, tied embeddings) with random weights:
N(0, 0.02), norms 1 + N(0, 0.1) and q/k/v biases N(0, 0.1), as megaopd.models.presets makes them, so a wrong
norm or bias mapping shows. The tokenizer is examples/tiny/tokenizer with its BPE vocabulary extended by
placeholder tokens "<xN>" up to the model's vocabulary, so every id a random model samples decodes to text.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_TOKENIZER = os.path.join(REPO, "examples", "tiny", "tokenizer")

# Qwen2.5 family sizes (config.json of the released models); "tiny-*" are the CPU smoke mode's.
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "tiny-student": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
    "tiny-teacher": dict(
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    ),
}
QWEN_VOCAB = 151936  # Qwen2.5 0.5B/1.5B/3B embedding rows
# Ids of the tiny tokenizer's specials (examples/tiny/README.md): pad <|endoftext|>=0, <|im_start|>=1, EOS <|im_end|>=2.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def hf_config_dict(shape: str, vocab_size: int, num_layers: int | None = None) -> dict:
    """config.json fields of a Qwen2 model of the named shape (optionally fewer layers)."""
    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    cfg = dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=vocab_size,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        use_sliding_window=False,
        hidden_act="silu",
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **copy.deepcopy(SHAPES[shape]),
    )
    if num_layers is not None:
        cfg["num_hidden_layers"] = num_layers
    return cfg


def random_hf_model(cfg: dict, device: torch.device | str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A transformers Qwen2ForCausalLM with random weights, built directly on `device` in `dtype`."""
    import transformers

    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = transformers.Qwen2Config(**fields, initializer_range=0.02)
    config.architectures = list(cfg["architectures"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
    return model.to(dtype).eval()


def write_tokenizer(out_dir: str, vocab_size: int) -> None:
    """The tiny tokenizer (chat template, EOS, pad) with placeholder tokens up to vocab_size ids."""
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(TINY_TOKENIZER):
        if name != "tokenizer.json":
            shutil.copy(os.path.join(TINY_TOKENIZER, name), os.path.join(out_dir, name))
    with open(os.path.join(TINY_TOKENIZER, "tokenizer.json")) as f:
        tok = json.load(f)
    used = set(tok["model"]["vocab"].values()) | {a["id"] for a in tok["added_tokens"]}
    if vocab_size < len(used):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tiny tokenizer's {len(used)} ids")
    # Unreachable by the merges (so encoding is unchanged), but decodable: any sampled id maps to text.
    for i in range(vocab_size):
        if i not in used:
            tok["model"]["vocab"][f"<x{i}>"] = i
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(tok, f, ensure_ascii=False)


def write_hf_dir(
    out_dir: str, shape: str, vocab_size: int, device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> str:
    """Saves a random model (safetensors, config.json, generation_config.json) and the tokenizer; skips
    the work when out_dir already holds the same config (a second run of the check reuses it)."""
    cfg = hf_config_dict(shape, vocab_size)
    stamp = os.path.join(out_dir, "gpu_check_build.json")
    want = {"shape": shape, "vocab_size": vocab_size, "dtype": str(dtype), "seed": seed}
    if os.path.isfile(stamp):
        with open(stamp) as f:
            if json.load(f) == want:
                return out_dir
    model = random_hf_model(cfg, device, dtype, seed)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.bos_token_id = BOS_ID
    model.save_pretrained(out_dir)
    write_tokenizer(out_dir, vocab_size)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with open(stamp, "w") as f:
        json.dump(want, f)
    return out_dir


def opd_lengths(n: int, scale: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """(prompt, response) lengths of n OPD-like rollouts: responses log-normal (median 2.2k, mean about
    3k), cut at 8k (the truncated tail), times scale. benchmarks/packing.py and the packing bench use them."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, 300, (n,), generator=g).float()
    responses = torch.exp(torch.randn(n, generator=g) * 0.8 + 7.7).clamp(64, 8192)
    return ([max(2, int(p * scale)) for p in prompts.tolist()], [max(1, int(r * scale)) for r in responses.tolist()])
