"""Read a Hugging Face config.json (Qwen2, Qwen2.5, Llama, Qwen3, Qwen3-MoE) into a small, validated description.

    cfg = read_hf_config("path/to/hf_dir")      # or a path to config.json, or the parsed dict
    check_layout(cfg, tp=2, pp=2, ep=1)          # ModelConfigError (one line, with the fix) if it cannot split
    padded_vocab_size(cfg.vocab_size, tp=2)      # rows megatron allocates: a multiple of 128 * tp

config.json is read directly (no transformers import) so both layouts of the RoPE settings work: real
Qwen2.5 / Llama 3 files carry a top-level `rope_theta` (and `rope_scaling`), transformers 5.x writes
`rope_parameters = {"rope_theta": ..., "rope_type": ...}`. This module imports neither torch nor megatron,
so the command-line tools validate their inputs in well under a second, before any expensive start-up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from megaopd.models.config import read_config_json

# architecture name in config.json -> family; everything the weight mapping knows how to place.
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",  # Qwen2 and Qwen2.5
    "LlamaForCausalLM": "llama",  # Llama 2 / 3 / 3.1 / 3.2
    "Qwen3ForCausalLM": "qwen3",  # Qwen3 dense (0.6B-32B): per-head q/k RMSNorm, explicit head_dim
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3-30B-A3B, 235B-A22B: Qwen3 attention, top-k routed experts
}

# megatron pads the vocabulary of its embedding and output layer to a multiple of this times TP, so
# every TP shard has the same, GEMM-friendly width; the padding rows are trimmed on export.
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


class InputError(ValueError):
    """Bad user input found before any expensive work; the message is one line naming it and the fix."""


class ModelConfigError(InputError):
    """A config or layout megaopd cannot build."""


@dataclass(frozen=True)
class LlamaRopeScaling:
    """Llama 3.1-style RoPE frequency scaling (`rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class HFModelConfig:
    """The parts of an HF decoder config that decide the megatron model and the weight layout."""

    architecture: str
    """HF class name from config.json `architectures[0]`, e.g. "Qwen2ForCausalLM"."""
    family: str
    """"qwen2", "llama", "qwen3" or "qwen3_moe"."""
    vocab_size: int
    """Real vocabulary rows of embed_tokens / lm_head (before megatron's padding)."""
    hidden_size: int
    intermediate_size: int
    """FFN width of each of gate_proj and up_proj (megatron ffn_hidden_size)."""
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """KV heads = megatron num_query_groups (GQA when smaller than the attention heads)."""
    head_dim: int
    """Per-head width; Qwen3 sets it independently of hidden_size / heads (megatron kv_channels)."""
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    """q/k/v projections carry a bias (always in Qwen2; never in supported Llama configs)."""
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: str = "float32"
    """Weight dtype named in config.json ("bfloat16", "float16", "float32")."""
    rope_scaling: LlamaRopeScaling | None = None
    qk_layernorm: bool = False
    """Per-head RMSNorm of queries and keys before RoPE (Qwen3 q_norm / k_norm; megatron qk_layernorm)."""
    num_experts: int = 0
    """Routed experts per layer; 0 for a dense model (megatron num_moe_experts)."""
    moe_intermediate_size: int = 0
    """FFN width of each expert's gate_proj and up_proj (megatron moe_ffn_hidden_size)."""
    moe_topk: int = 0
    """Experts each token is routed to (HF num_experts_per_tok; megatron moe_router_topk)."""
    norm_topk_prob: bool = True
    """The top-k routing weights are renormalized to sum to one (megatron: softmax after top-k)."""
    router_aux_loss_coef: float = 0.0
    """Load-balancing loss coefficient of the HF config (megatron moe_aux_loss_coeff for a trained model)."""
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The config.json dict as read, written back unchanged on export."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _load_json(source: str | os.PathLike | Mapping[str, Any]) -> dict:
    """The config as a dict: a dict given is copied, a path read by models.config.read_config_json (an HF
    directory, a checkpoint's hf/, or the file), whose refusals become ModelConfigError."""
    if isinstance(source, Mapping):
        return dict(source)
    try:
        return read_config_json(os.fspath(source))
    except FileNotFoundError as e:
        raise ModelConfigError(f"no HF config: {e}") from None
    except ValueError as e:  # not JSON, or not an object: the message names the file
        raise ModelConfigError(str(e)) from None


def _rope(raw: Mapping[str, Any]) -> tuple[float, LlamaRopeScaling | None]:
    # transformers 5.x: rope_parameters holds theta and the scaling; older files: top-level keys.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = raw.get("rope_theta", params.get("rope_theta", scaling.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type == "llama3":
        s = LlamaRopeScaling(
            factor=float(merged.get("factor", 8.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
        )
        # megatron-core 0.16 applies llama3 scaling with fixed low/high factors and context length;
        # only the factor is a parameter (see compat.rope_kwargs).
        if (s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) != (1.0, 4.0, 8192):
            raise ModelConfigError(
                f"llama3 RoPE scaling with low_freq_factor={s.low_freq_factor}, high_freq_factor="
                f"{s.high_freq_factor}, original_max_position_embeddings={s.original_max_position_embeddings}"
                " is not supported (megatron-core fixes them at 1, 4, 8192)"
            )
        return float(theta), s
    raise ModelConfigError(f"RoPE type {rope_type!r} is not supported; supported: default, llama3")


def read_hf_config(source: str | os.PathLike | Mapping[str, Any]) -> HFModelConfig:
    """Parses an HF directory, config.json path or dict; ModelConfigError for anything unsupported."""
    raw = _load_json(source)
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"unsupported architecture {arch!r} (model_type {raw.get('model_type')!r}); supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        cfg_fields = dict(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        )
    except KeyError as e:
        raise ModelConfigError(f"config.json lacks {e.args[0]!r}, which a {arch} config must have") from None
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act {raw['hidden_act']!r} is not supported; megaopd maps SwiGLU (silu)")
    if family == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise ModelConfigError(
            "Llama with attention_bias or mlp_bias is not supported (o_proj/MLP biases "
            "have no megatron equivalent here); supported: bias-free Llama"
        )
    if family in ("qwen2", "qwen3", "qwen3_moe") and raw.get("use_sliding_window"):
        raise ModelConfigError(
            f"{arch} with use_sliding_window=true is not supported; set it to false "
            "(all released Qwen2/2.5/3 checkpoints use full attention)"
        )
    if family in ("qwen3", "qwen3_moe") and raw.get("attention_bias"):
        raise ModelConfigError(
            f"{arch} with attention_bias=true is not supported (its o_proj bias has no "
            "megatron equivalent here); released Qwen3 checkpoints have attention_bias=false"
        )
    moe = _moe_fields(raw, arch) if family == "qwen3_moe" else {}
    theta, scaling = _rope(raw)
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").replace("torch.", "")
    return HFModelConfig(
        architecture=arch,
        family=family,
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=family == "qwen2",  # HF Qwen2Attention hard-codes bias=True on q/k/v; Qwen3 has none
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=dtype,
        raw=raw,
        **cfg_fields,
        **moe,
    )


def _moe_fields(raw: Mapping[str, Any], arch: str) -> dict:
    """The routed-expert fields of a Qwen3-MoE config (every layer sparse, no shared expert)."""
    # Released configs say num_experts; transformers 5 writes num_local_experts on save.
    n = raw.get("num_experts", raw.get("num_local_experts"))
    try:
        fields = dict(
            num_experts=int(n),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            moe_topk=int(raw["num_experts_per_tok"]),
        )
    except (KeyError, TypeError):
        raise ModelConfigError(
            f"{arch} config.json needs num_experts, moe_intermediate_size and num_experts_per_tok"
        ) from None
    if not 1 <= fields["moe_topk"] <= fields["num_experts"]:
        raise ModelConfigError(
            f"num_experts_per_tok={fields['moe_topk']} must be between 1 and num_experts={fields['num_experts']}"
        )
    if raw.get("mlp_only_layers") or int(raw.get("decoder_sparse_step", 1)) != 1:
        raise ModelConfigError(
            f"{arch} with dense layers (mlp_only_layers={raw.get('mlp_only_layers')}, "
            f"decoder_sparse_step={raw.get('decoder_sparse_step')}) is not supported; "
            "megaopd maps all-MoE layers (mlp_only_layers=[], decoder_sparse_step=1)"
        )
    return dict(
        fields,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.0)),
    )


def check_layout(cfg: HFModelConfig, tp: int, pp: int, ep: int = 1) -> None:
    """Raises ModelConfigError (one line, with the fix) if the model cannot be split at TP=tp, PP=pp, EP=ep."""
    if tp < 1 or pp < 1 or ep < 1:
        raise ModelConfigError(f"tp, pp and ep must be >= 1 (got tp={tp}, pp={pp}, ep={ep})")
    if ep > 1 and not cfg.is_moe:
        raise ModelConfigError(f"ep={ep} but {cfg.architecture} has no experts; use ep=1 for a dense model")
    if cfg.is_moe and cfg.num_experts % ep:
        raise ModelConfigError(
            f"ep={ep} does not divide num_experts={cfg.num_experts}; choose ep among {_divisors(cfg.num_experts)}"
        )
    if cfg.is_moe and cfg.moe_intermediate_size % tp:
        raise ModelConfigError(
            f"tp={tp} does not divide moe_intermediate_size={cfg.moe_intermediate_size} "
            "(experts are split over TP like the dense MLP)"
        )
    if cfg.num_attention_heads % tp:
        raise ModelConfigError(
            f"tp={tp} does not divide num_attention_heads={cfg.num_attention_heads}; "
            f"choose tp among {_divisors(cfg.num_attention_heads)}"
        )
    if cfg.num_key_value_heads % tp:
        raise ModelConfigError(
            f"tp={tp} does not divide the {cfg.num_key_value_heads} key/value heads "
            f"(query groups); choose tp among {_divisors(cfg.num_key_value_heads)}"
        )
    if not cfg.is_moe and cfg.intermediate_size % tp:  # a MoE model's intermediate_size is unused
        raise ModelConfigError(f"tp={tp} does not divide intermediate_size={cfg.intermediate_size}")
    if cfg.num_layers % pp:
        raise ModelConfigError(
            f"pp={pp} does not divide num_hidden_layers={cfg.num_layers}; choose pp among {_divisors(cfg.num_layers)}"
        )


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY) -> int:
    """Megatron's vocabulary rows: vocab_size rounded up to a multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def layers_per_stage(cfg: HFModelConfig, pp: int) -> int:
    """Transformer layers on each pipeline stage (uniform split; check_layout guarantees it divides)."""
    return cfg.num_layers // pp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def params_per_rank(hf: HFModelConfig, tp: int, pp: int, ep: int = 1) -> int:
    """Parameters held by one rank of the largest pipeline stage (megatron's sharding and vocab padding).
    MoE layers: each rank holds num_experts / ep experts, each split over TP like a dense MLP, plus the
    whole router."""
    h, hd = hf.hidden_size, hf.head_dim
    q_dim, kv_dim = hf.num_attention_heads * hd, hf.num_key_value_heads * hd
    qkv_out = q_dim + 2 * kv_dim
    if hf.num_experts:
        mlp = hf.num_experts // ep * 3 * h * hf.moe_intermediate_size
        router = hf.num_experts * h
    else:
        mlp, router = 3 * h * hf.intermediate_size, 0
    sharded = h * qkv_out + (qkv_out if hf.qkv_bias else 0) + q_dim * h + mlp
    per_layer = sharded // tp + 2 * h + router  # the two RMSNorm weights are whole on every TP rank
    layers = (hf.num_layers // pp) * per_layer
    vocab_shard = padded_vocab_size(hf.vocab_size, tp) // tp * h
    if pp == 1:
        return layers + vocab_shard * (1 if hf.tie_word_embeddings else 2) + h
    first = layers + vocab_shard
    last = layers + vocab_shard + h  # tied: megatron keeps a copy of the embedding on the last stage
    return max(first, last)
