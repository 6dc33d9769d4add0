"""Random HF models from config dicts, built offline with transformers (tests, benchmarks, CPU demo).

    python -m megaopd.models.presets tiny-qwen2 /tmp/tiny-qwen2     # writes an HF dir (weights + tokenizer)

make_hf_model(name_or_config, out_dir) saves a randomly initialized model with a WordLevel tokenizer of
matching size ("t0 t1 ..."), so every megaopd path (conversion, scoring, the embedded engine) can run
without a download. Sizes are small on purpose; "qwen2-100m" is a ~0.1B model for timing.
"""

from __future__ import annotations

import argparse
import copy
import os

# HF config.json fields; "architectures" selects the transformers class.
PRESETS: dict[str, dict] = {
    # GQA (6 heads, 2 KV groups), QKV bias, theta 1e6, untied, vocab not a multiple of 128 * TP.
    "tiny-qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=300,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    "tiny-qwen2-tied": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=300,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    # Llama 3.1-style: no biases, llama3 RoPE scaling, theta 5e5; at TP=2 a whole vocab shard is padding.
    "tiny-llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # Qwen3: per-head q/k RMSNorm, head_dim 32 with 4 heads of a 64-wide model (4 * 32 != 64), no biases.
    "tiny-qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    "tiny-qwen3-tied": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    # Qwen3-MoE: 8 experts, top 2 with renormalized weights, every layer sparse, no shared expert.
    "tiny-qwen3-moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=200,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    # ~0.1B parameters (100.1M: Qwen2.5-style GQA, 12 layers, a 32k vocab, tied) for benchmarks.
    "qwen2-100m": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
}


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def make_tokenizer(vocab_size: int, out_dir: str) -> None:
    """A WordLevel tokenizer over "t0".."t{V-4}" plus <unk>, <s>, </s>: ids cover the vocabulary.

    Load it with PreTrainedTokenizerFast.from_pretrained: beside a qwen2 config.json, AutoTokenizer
    in transformers 5 chooses Qwen2Tokenizer, which rebuilds a byte-level pipeline around this vocabulary.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 3)}
    vocab.update({"<unk>": vocab_size - 3, "<s>": vocab_size - 2, "</s>": vocab_size - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        out_dir
    )


def make_hf_model(preset: str | dict, out_dir: str, seed: int = 0, dtype: str = "float32", init_std: float = 0.02):
    """Saves a random model (safetensors) + config.json + tokenizer to out_dir; returns the HF model.

    init_std: weights ~ N(0, init_std); norms get 1 + N(0, 0.1) noise so a wrong norm mapping shows.
    """
    import torch
    import transformers

    raw = preset_config(preset) if isinstance(preset, str) else copy.deepcopy(preset)
    arch = raw["architectures"][0]
    config_cls = transformers.AutoConfig.for_model(raw["model_type"]).__class__
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    config = config_cls(**fields, initializer_range=init_std)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)  # HF initializes biases to zero; random ones test their placement
            elif name.endswith("mlp.gate.weight"):
                # MoE router: well-separated expert scores, so float32 rounding differences between
                # two implementations never change which experts a token picks.
                p.normal_(0, 1.0)
    model = model.to(getattr(torch, dtype))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    make_tokenizer(config.vocab_size, out_dir)
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = ap.parse_args(argv)
    make_hf_model(a.preset, a.out_dir, a.seed, a.dtype)
    print(f"wrote {a.preset} to {a.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
