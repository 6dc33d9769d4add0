"""The one HF <-> Megatron weight mapping: used by tools/convert_*.py and by live weight sync.

Two directions, both per rank:
    shard_hf_weights(get_hf, cfg, tp_rank, tp_size, pp_rank, pp_size)  HF tensors -> this rank's megatron shard
    megaopd.sync.gather.gather_hf_weights(state, cfg, tp_group, pp_group)  this rank's shard -> full HF
                                                                        tensors (collective; built on merge_shards)
and their single-process cores, which need no process group:
    shard_tensor(rule, hf_tensors, cfg, tp_rank, tp_size) / merge_shards(rule, shards, cfg)

Layout (H hidden, nh heads, ng query groups = KV heads, nq = nh / ng, d head dim, F ffn, V vocab,
Vp = V padded to a multiple of 128 * TP):
  embedding.word_embeddings.weight [Vp/tp, H]   <- model.embed_tokens.weight [V, H], zero-padded, rows split
  output_layer.weight              [Vp/tp, H]   <- lm_head.weight (or embed_tokens when tied), same
  decoder.final_layernorm.weight   [H]          <- model.norm.weight, replicated
  per layer i (HF index = i + pp_rank * L/pp, megatron index local to the stage):
  self_attention.linear_qkv.weight [(nq+2) d ng/tp, H]: for each query group g of this rank,
        [q heads of g (nq*d rows); k_g (d rows); v_g (d rows)]  <- q_proj, k_proj, v_proj (bias likewise)
  self_attention.linear_proj.weight [H, nh d / tp]  <- o_proj, columns split (row-parallel)
  mlp.linear_fc1.weight [2F/tp, H] = [gate rows of this rank; up rows of this rank] <- gate_proj, up_proj
  mlp.linear_fc2.weight [H, F/tp]  <- down_proj, columns split (row-parallel)
  input_layernorm.weight / pre_mlp_layernorm.weight [H] <- input_layernorm / post_attention_layernorm
  (Transformer Engine fuses those norms: self_attention.linear_qkv.layer_norm_weight and
   mlp.linear_fc1.layer_norm_weight; both names are understood, `fused_norms` picks which to produce.)
Tied embeddings: with PP > 1 the last stage holds its own copy as output_layer.weight (megatron keeps
the two in sync); it is filled from embed_tokens and never exported. With PP = 1 there is no copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from megaopd.models.hf_config import HFModelConfig, layers_per_stage, padded_vocab_size

# How a megatron tensor is split over TP and combined from HF tensors.
REPLICATED = "replicated"  # same on every TP rank (norms)
ROW = "row"                # row-parallel linear: HF dim 1 (input features) split in tp chunks
QKV = "qkv"                # fused q/k/v, interleaved by query group, groups split over TP
FC1 = "fc1"                # [gate; up], each split over TP on dim 0 and concatenated per rank
VOCAB = "vocab"            # rows padded to Vp with zeros, then split over TP on dim 0

HFGetter = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class WeightRule:
    """One megatron tensor of a stage and the HF tensors it is made of."""

    megatron: str
    """Name in this stage's GPTModel.state_dict() (layer indices local to the stage)."""
    hf: tuple[str, ...]
    """HF names in the order `kind` combines them (q, k, v for QKV; gate, up for FC1)."""
    kind: str
    export: bool = True
    """False only for the last stage's copy of tied embeddings (HF stores them once)."""


def stage_rules(cfg: HFModelConfig, pp_rank: int = 0, pp_size: int = 1,
                fused_norms: bool = False) -> list[WeightRule]:
    """The rules of PP stage `pp_rank`, in a fixed order (the same on every rank)."""
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    n_local = layers_per_stage(cfg, pp_size)
    offset = pp_rank * n_local
    rules: list[WeightRule] = []
    if first:
        rules.append(WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB))
    for i in range(n_local):
        m, h = f"decoder.layers.{i}.", f"model.layers.{offset + i}."
        in_norm = "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight"
        rules += [
            WeightRule(m + in_norm, (h + "input_layernorm.weight",), REPLICATED),
            WeightRule(m + "self_attention.linear_qkv.weight",
                       tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"), QKV),
        ]
        if cfg.qkv_bias:
            rules.append(WeightRule(m + "self_attention.linear_qkv.bias",
                                    tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"), QKV))
        rules += [
            WeightRule(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), ROW),
            WeightRule(m + mlp_norm, (h + "post_attention_layernorm.weight",), REPLICATED),
            WeightRule(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), FC1),
            WeightRule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), ROW),
        ]
    if last:
        rules.append(WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED))
        if not cfg.tie_word_embeddings:
            rules.append(WeightRule("output_layer.weight", ("lm_head.weight",), VOCAB))
        elif not first:
            rules.append(WeightRule("output_layer.weight", ("model.embed_tokens.weight",), VOCAB, export=False))
    return rules


def hf_shapes(cfg: HFModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the model and its shape (what the export produces, in HF order)."""
    H, F, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, H)
            if cfg.qkv_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (H, q)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        shapes[p + "mlp.gate_proj.weight"] = (F, H)
        shapes[p + "mlp.up_proj.weight"] = (F, H)
        shapes[p + "mlp.down_proj.weight"] = (H, F)
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    return shapes


# ---------------------------------------------------------------------------------------------------
# Single-process cores: one rule, explicit TP rank, no communication.

def shard_tensor(rule: WeightRule, hf: Sequence[torch.Tensor], cfg: HFModelConfig,
                 tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP shard `tp_rank` of the megatron tensor built from the HF tensors of `rule` (in rule.hf order)."""
    if rule.kind == REPLICATED:
        return hf[0]
    if rule.kind == ROW:
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    if rule.kind == FC1:
        gate, up = hf
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    if rule.kind == VOCAB:
        (w,) = hf
        vp = padded_vocab_size(cfg.vocab_size, tp_size)
        padded = w.new_zeros((vp,) + tuple(w.shape[1:]))  # padding rows stay zero
        padded[: w.shape[0]] = w
        return padded.chunk(tp_size, dim=0)[tp_rank]
    if rule.kind == QKV:
        ng, nq, d = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
        q, k, v = hf
        rest = tuple(q.shape[1:])  # (H,) for weights, () for biases
        # [ng, (nq + 2) d, *rest]: each query group's q heads, then its k head, then its v head
        fused = torch.cat([q.reshape(ng, nq * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], 1)
        per_rank = ng // tp_size
        return fused[tp_rank * per_rank:(tp_rank + 1) * per_rank].reshape(-1, *rest)
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def merge_shards(rule: WeightRule, shards: Sequence[torch.Tensor], cfg: HFModelConfig) -> list[torch.Tensor]:
    """Inverse of shard_tensor: the TP shards (in TP rank order) -> HF tensors in rule.hf order.

    The results own their memory (no views of the shards or of each other), so they can be written
    with safetensors or handed to another thread while training continues.
    """
    if rule.kind == REPLICATED:
        return [shards[0].clone()]
    if rule.kind == ROW:
        return [torch.cat(list(shards), dim=1)]
    if rule.kind == FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)]
    if rule.kind == VOCAB:
        return [torch.cat(list(shards), dim=0)[: cfg.vocab_size].clone()]  # drop the padding rows
    if rule.kind == QKV:
        ng, nq, d = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
        full = torch.cat(list(shards), dim=0)
        rest = tuple(full.shape[1:])
        full = full.reshape(ng, (nq + 2) * d, *rest)
        q = full[:, : nq * d].reshape(ng * nq * d, *rest).clone()
        k = full[:, nq * d:(nq + 1) * d].reshape(ng * d, *rest).clone()
        v = full[:, (nq + 1) * d:].reshape(ng * d, *rest).clone()
        return [q, k, v]
    raise ValueError(f"unknown rule kind {rule.kind!r}")


# ---------------------------------------------------------------------------------------------------
# HF -> this rank's megatron shard.

def shard_hf_weights(get_hf: HFGetter | Mapping[str, torch.Tensor], cfg: HFModelConfig, tp_rank: int,
                     tp_size: int, pp_rank: int = 0, pp_size: int = 1,
                     fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """{megatron name: this rank's shard} for PP stage pp_rank, TP rank tp_rank.

    get_hf: a mapping or a function name -> full HF tensor; only the tensors this stage needs are
    requested (so a lazy safetensors reader touches only them). Shapes are checked against cfg.
    """
    get = get_hf.__getitem__ if isinstance(get_hf, Mapping) else get_hf
    expected = hf_shapes(cfg)
    out = {}
    for rule in stage_rules(cfg, pp_rank, pp_size, fused_norms):
        tensors = []
        for name in rule.hf:
            t = get(name)
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"HF tensor {name} has shape {tuple(t.shape)}, config.json implies "
                                 f"{expected[name]}; the weights do not belong to this config")
            tensors.append(t)
        out[rule.megatron] = shard_tensor(rule, tensors, cfg, tp_rank, tp_size)
    return out


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters by megatron name (wrappers such as DDP's `module.` prefix removed)."""
    return {strip_wrapper_prefix(n): p for n, p in model.named_parameters()}


def uses_fused_norms(names) -> bool:
    return any(n.endswith("layer_norm_weight") for n in names)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, get_hf: HFGetter | Mapping[str, torch.Tensor],
                    cfg: HFModelConfig, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> None:
    """Copies HF weights into this rank's GPTModel stage (in place; dtype must match for exactness)."""
    params = model_state(model)
    shards = shard_hf_weights(get_hf, cfg, tp_rank, tp_size, pp_rank, pp_size, uses_fused_norms(params))
    missing, unexpected = set(params) - set(shards), set(shards) - set(params)
    if missing or unexpected:
        raise ValueError(f"weight mapping does not match the model: megatron params without HF source "
                         f"{sorted(missing)[:4]}, mapped names absent from the model {sorted(unexpected)[:4]}")
    for name, p in params.items():
        src = shards[name]
        if src.shape != p.shape:
            raise ValueError(f"{name}: mapped shard {tuple(src.shape)} != model param {tuple(p.shape)}")
        p.copy_(src)


def strip_wrapper_prefix(name: str) -> str:
    """A parameter name without wrapper prefixes (DDP's `module.`)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name
