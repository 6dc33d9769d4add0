"""The one HF <-> Megatron weight mapping: used by tools/convert_*.py and by live weight sync.

Two directions, both per rank:
    shard_hf_weights(get_hf, cfg, Placement(tp_rank=..., tp_size=..., ...))  HF tensors -> this rank's megatron shard
    megaopd.models.gather.gather_hf_weights(state, cfg, tp_group, pp_group)  this rank's shard -> full HF
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
  self_attention.q_layernorm.weight / k_layernorm.weight [d] <- self_attn.q_norm / k_norm (Qwen3), replicated
  MoE layers (Qwen3-MoE) replace linear_fc1/fc2 by:
  mlp.router.weight [E, H]  <- mlp.gate.weight, replicated over TP and EP
  mlp.experts.local_experts.j.linear_fc1 / linear_fc2 <- mlp.experts.(ep_rank * E/ep + j).gate/up/down_proj,
        each split over TP like the dense MLP; rule.expert marks them (one EP rank holds each)
  (Transformer Engine fuses those norms: self_attention.linear_qkv.layer_norm_weight and
   mlp.linear_fc1.layer_norm_weight; both names are understood, `fused_norms` picks which to produce.)
Tied embeddings: with PP > 1 the last stage holds its own copy as output_layer.weight (megatron keeps
the two in sync); it is filled from embed_tokens and never exported. With PP = 1 there is no copy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from megaopd.models.hf_config import HFModelConfig, InputError, layers_per_stage, padded_vocab_size

# How a megatron tensor is split over TP and combined from HF tensors.
REPLICATED = "replicated"  # same on every TP rank (norms)
ROW = "row"  # row-parallel linear: HF dim 1 (input features) split in tp chunks
QKV = "qkv"  # fused q/k/v, interleaved by query group, groups split over TP
FC1 = "fc1"  # [gate; up], each split over TP on dim 0 and concatenated per rank
VOCAB = "vocab"  # rows padded to Vp with zeros, then split over TP on dim 0

HFGetter = Callable[[str], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Which shard of the model a rank holds: its ranks in the TP, PP and EP groups and those groups' sizes.

    The defaults are one process holding the whole model; a dense model ignores the EP pair."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1


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
    expert: bool = False
    """A routed expert's weight: held by one EP rank only (the others hold other experts)."""


def _expert_rules(cfg: HFModelConfig, m: str, h: str, ep_rank: int, ep_size: int) -> list[WeightRule]:
    """Router and this EP rank's experts of one MoE layer (megatron SequentialMLP names).

    EP rank r holds the global experts r * E/ep ... (r+1) * E/ep - 1 as local_experts.0 ...; each
    expert's fc1/fc2 is split over TP like the dense MLP (megatron's expert TP = TP).
    """
    per_rank = cfg.num_experts // ep_size
    rules = [WeightRule(m + "mlp.router.weight", (h + "mlp.gate.weight",), REPLICATED)]
    for j in range(per_rank):
        e, x = f"{h}mlp.experts.{ep_rank * per_rank + j}.", f"{m}mlp.experts.local_experts.{j}."
        rules += [
            WeightRule(x + "linear_fc1.weight", (e + "gate_proj.weight", e + "up_proj.weight"), FC1, expert=True),
            WeightRule(x + "linear_fc2.weight", (e + "down_proj.weight",), ROW, expert=True),
        ]
    return rules


def stage_rules(
    cfg: HFModelConfig,
    pp_rank: int = 0,
    pp_size: int = 1,
    fused_norms: bool = False,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> list[WeightRule]:
    """The rules of PP stage `pp_rank` on expert-parallel rank `ep_rank`, in a fixed order.

    Only the expert rules (rule.expert) depend on ep_rank; the others are the same on every EP rank
    (EP ranks are data-parallel replicas of everything but the experts).
    """
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    n_local = layers_per_stage(cfg, pp_size)
    offset = pp_rank * n_local
    rules: list[WeightRule] = []
    if first:
        rules.append(WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB))
    for i in range(n_local):
        m, h = f"decoder.layers.{i}.", f"model.layers.{offset + i}."
        in_norm = "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"
        # A MoE layer keeps its own pre-MLP norm even with Transformer Engine (nothing to fuse it into).
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if fused_norms and not cfg.is_moe else "pre_mlp_layernorm.weight"
        rules += [
            WeightRule(m + in_norm, (h + "input_layernorm.weight",), REPLICATED),
            WeightRule(
                m + "self_attention.linear_qkv.weight", tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"), QKV
            ),
        ]
        if cfg.qkv_bias:
            rules.append(
                WeightRule(
                    m + "self_attention.linear_qkv.bias", tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"), QKV
                )
            )
        if cfg.qk_layernorm:  # one [head_dim] weight shared by all heads: replicated over TP
            rules += [
                WeightRule(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), REPLICATED),
                WeightRule(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), REPLICATED),
            ]
        rules += [
            WeightRule(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), ROW),
            WeightRule(m + mlp_norm, (h + "post_attention_layernorm.weight",), REPLICATED),
        ]
        if cfg.is_moe:
            rules += _expert_rules(cfg, m, h, ep_rank, ep_size)
        else:
            rules += [
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
        if cfg.qk_layernorm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "self_attn.o_proj.weight"] = (H, q)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if cfg.is_moe:
            Fm = cfg.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (cfg.num_experts, H)
            for e in range(cfg.num_experts):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (Fm, H)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (Fm, H)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (H, Fm)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (F, H)
            shapes[p + "mlp.up_proj.weight"] = (F, H)
            shapes[p + "mlp.down_proj.weight"] = (H, F)
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    return shapes


# ---------------------------------------------------------------------------------------------------
# Single-process cores: one rule, explicit TP rank, no communication.


def shard_tensor(
    rule: WeightRule, hf: Sequence[torch.Tensor], cfg: HFModelConfig, tp_rank: int, tp_size: int
) -> torch.Tensor:
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
        return fused[tp_rank * per_rank : (tp_rank + 1) * per_rank].reshape(-1, *rest)
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
        k = full[:, nq * d : (nq + 1) * d].reshape(ng * d, *rest).clone()
        v = full[:, (nq + 1) * d :].reshape(ng * d, *rest).clone()
        return [q, k, v]
    raise ValueError(f"unknown rule kind {rule.kind!r}")


# ---------------------------------------------------------------------------------------------------
# HF -> this rank's megatron shard.


def shard_hf_weights(
    get_hf: HFGetter | Mapping[str, torch.Tensor],
    cfg: HFModelConfig,
    place: Placement,
    fused_norms: bool = False,
) -> dict[str, torch.Tensor]:
    """{megatron name: this rank's shard} for the rank at `place` (its PP stage, TP rank and EP rank).

    get_hf: a mapping or a function name -> full HF tensor; only the tensors this stage needs are
    requested (so a lazy safetensors reader touches only them). Shapes are checked against cfg.
    """
    get = get_hf.__getitem__ if isinstance(get_hf, Mapping) else get_hf
    expected = hf_shapes(cfg)
    out = {}
    for rule in stage_rules(cfg, place.pp_rank, place.pp_size, fused_norms, place.ep_rank, place.ep_size):
        tensors = []
        for name in rule.hf:
            t = get(name)
            if tuple(t.shape) != expected[name]:
                raise ValueError(
                    f"HF tensor {name} has shape {tuple(t.shape)}, config.json implies "
                    f"{expected[name]}; the weights do not belong to this config"
                )
            tensors.append(t)
        out[rule.megatron] = shard_tensor(rule, tensors, cfg, place.tp_rank, place.tp_size)
    return out


EXPECTED_UNUSED = (
    re.compile(r"(^|\.)rotary_emb\.inv_freq$"),  # RoPE's buffer, recomputed from rope_theta
)
"""HF tensors a checkpoint may hold that the model does not read (besides lm_head.weight with tied embeddings,
a copy of embed_tokens some savers write)."""


class WeightsMismatch(InputError):
    """An HF folder's tensors are not the model its config.json describes: leftovers or missing tensors."""


def _count(names, pattern: str) -> int:
    """1 + the highest index `pattern`'s group captures among `names` (0: none)."""
    found = [int(m.group(1)) for n in names for m in [re.match(pattern, n)] if m]
    return max(found) + 1 if found else 0


def check_all_used(names, cfg: HFModelConfig, where: str) -> None:
    """Every tensor of an HF folder (`names`) is one the config's model reads, or expected to be unused
    (EXPECTED_UNUSED); every tensor the model reads is there. Else WeightsMismatch, one line naming the tensors
    and the config.json field that disagrees (num_hidden_layers: 2 but the weights hold 3 layers)."""
    names = set(names)
    wanted = set(hf_shapes(cfg))
    left = sorted(
        n
        for n in names - wanted
        if not any(p.search(n) for p in EXPECTED_UNUSED) and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    )
    missing = sorted(wanted - names)
    if not left and not missing:
        return
    fields = []
    layers = _count(names, r"model\.layers\.(\d+)\.")
    if layers and layers != cfg.num_layers:
        fields.append(f"num_hidden_layers: {cfg.num_layers} but the weights hold {layers} layers")
    experts = _count(names, r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
    if experts != cfg.num_experts:
        fields.append(f"num_experts: {cfg.num_experts} but the weights hold {experts} experts a layer")
    if any(n.endswith("_proj.bias") for n in left + missing):
        fields.append(f"attention bias: {cfg.qkv_bias} but the weights {'hold' if left else 'lack'} q/k/v biases")
    if any(n.endswith(("q_norm.weight", "k_norm.weight")) for n in left + missing):
        fields.append(f"q/k norms (qk_layernorm): {cfg.qk_layernorm} but the weights {'hold' if left else 'lack'} them")
    if "lm_head.weight" in missing:
        fields.append("tie_word_embeddings: false but the weights hold no lm_head.weight")

    def some(items: list[str]) -> str:
        return ", ".join(items[:4]) + (f" (+{len(items) - 4} more)" if len(items) > 4 else "")

    parts = ([f"{len(left)} tensors the model does not use ({some(left)})"] if left else []) + (
        [f"{len(missing)} tensors missing ({some(missing)})"] if missing else []
    )
    why = "; ".join(fields) if fields else "the weights and config.json describe different models"
    raise WeightsMismatch(
        f"{where}: {' and '.join(parts)}: config.json {why}; fix config.json to match the weights (or use the "
        f"folder they were saved with)"
    )


def check_config_matches_shards(saved: Mapping[str, tuple[int, ...]], cfg: HFModelConfig, where: str) -> None:
    """A megatron checkpoint's saved tensor shapes (safe_load.saved_shapes: layers stacked on the first dim)
    against the config.json beside them: layers, hidden size, FFN size, vocabulary. WeightsMismatch naming
    the config field and what the shards hold, before any rank loads (the load would fail deep in torch's
    checkpoint reader)."""
    found = []

    def shape(name: str) -> tuple[int, ...] | None:
        return saved.get(name)

    proj = shape("decoder.layers.self_attention.linear_proj.weight")
    if proj is not None and proj[0] != cfg.num_layers:
        found.append(f"num_hidden_layers: {cfg.num_layers} but the shards hold {proj[0]} layers")
    norm = shape("decoder.final_layernorm.weight")
    if norm is not None and norm[0] != cfg.hidden_size:
        found.append(f"hidden_size: {cfg.hidden_size} but the shards' hidden size is {norm[0]}")
    fc2 = shape("decoder.layers.mlp.linear_fc2.weight")
    if fc2 is not None and not cfg.is_moe and fc2[-1] != cfg.intermediate_size:
        found.append(f"intermediate_size: {cfg.intermediate_size} but the shards' is {fc2[-1]}")
    emb = shape("embedding.word_embeddings.weight")
    if emb is not None and not cfg.vocab_size <= emb[0] < cfg.vocab_size + 128 * 64:
        found.append(f"vocab_size: {cfg.vocab_size} but the shards hold {emb[0]} (padded) embedding rows")
    if found:
        raise WeightsMismatch(
            f"{where}: config.json does not describe the checkpoint's shards: {'; '.join(found)}; restore the "
            f"config.json saved with the checkpoint"
        )


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters by megatron name (wrappers such as DDP's `module.` prefix removed)."""
    return {strip_wrapper_prefix(n): p for n, p in model.named_parameters()}


def uses_fused_norms(names) -> bool:
    return any(n.endswith("layer_norm_weight") for n in names)


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module,
    get_hf: HFGetter | Mapping[str, torch.Tensor],
    cfg: HFModelConfig,
    place: Placement,
) -> None:
    """Copies HF weights into this rank's GPTModel stage at `place` (in place; dtype must match for exactness).
    A mapping (an HF folder's HFWeights) is first checked whole: every tensor used or expected unused
    (check_all_used)."""
    if isinstance(get_hf, Mapping):
        check_all_used(get_hf.keys(), cfg, getattr(get_hf, "hf_dir", "the HF weights"))
    params = model_state(model)
    shards = shard_hf_weights(get_hf, cfg, place, uses_fused_norms(params))
    missing, unexpected = set(params) - set(shards), set(shards) - set(params)
    if missing or unexpected:
        raise ValueError(
            f"weight mapping does not match the model: megatron params without HF source "
            f"{sorted(missing)[:4]}, mapped names absent from the model {sorted(unexpected)[:4]}"
        )
    for name, p in params.items():
        src = shards[name]
        if src.shape != p.shape:
            raise ValueError(f"{name}: mapped shard {tuple(src.shape)} != model param {tuple(p.shape)}")
        p.copy_(src)


# ---------------------------------------------------------------------------------------------------
# This stage's shards at any TP x EP -> full HF tensors (collective over TP and EP).


def gather_stage_hf_weights(
    state: Mapping[str, torch.Tensor],
    cfg: HFModelConfig,
    tp_group=None,
    ep_group=None,
    pp_rank: int = 0,
    pp_size: int = 1,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, full tensor) for every exported tensor of PP stage `pp_rank`, on every rank of
    the stage (no PP traffic: a weight-sync sender per stage streams them; a converter collects them).

    Works at any expert-parallel size: weights outside the experts are the same on all EP ranks and
    are gathered over TP only; each expert slot is gathered over TP, then over the EP group (EP rank
    r contributes its local expert j = global expert r * E/ep + j). ep_group None = EP 1. Collective:
    every rank of tp_group and ep_group must consume the whole iterator. Tensors are detached copies
    in `dtype` (default: that of the linear weights, as gather_hf_weights).
    """
    state = {strip_wrapper_prefix(k): v for k, v in state.items()}
    fused = uses_fused_norms(state)
    ep_size = ep_group.size() if ep_group is not None else 1
    ep_rank = ep_group.rank() if ep_group is not None else 0
    dtype = dtype or state["decoder.layers.0.self_attention.linear_qkv.weight"].dtype
    per_ep = [stage_rules(cfg, pp_rank, pp_size, fused, e, ep_size) for e in range(ep_size)]
    for i, rule in enumerate(per_ep[ep_rank]):
        if not rule.export:
            continue
        merged = merge_shards(rule, _gather(with_adapter(state, rule.megatron), tp_group), cfg)
        if not rule.expert:
            yield from ((n, t.to(dtype)) for n, t in zip(rule.hf, merged))
            continue
        # Rule i is the same local slot on every EP rank (same order), holding a different expert.
        for k, t in enumerate(merged):
            for e, part in enumerate(_gather(t, ep_group)):
                yield per_ep[e][i].hf[k], part.to(dtype)


# ---------------------------------------------------------------------------------------------------
# LoRA adapters (models/lora.py) in the same mapping. An adapted linear `X.weight` has `X.adapter.lora_A` and
# `X.adapter.lora_B` beside it; A of a column-parallel base (linear_qkv, linear_fc1) is replicated and B split
# like the base's rows, so B maps to HF exactly as the base weight does (QKV: per query group; FC1: gate and up)
# and A is the same for each of the HF projections the fused linear holds (q, k, v; gate, up). A row-parallel
# base (linear_proj, linear_fc2) has A split like its columns (ROW) and B replicated.

ADAPTER_A, ADAPTER_B = "adapter.lora_A", "adapter.lora_B"
LORA_SCALE = "lora_scale"
"""The attribute of an adapter's lora_B parameter holding alpha / r (models/lora.py sets it), so a state of
parameters carries what merging it needs."""
PEFT_PREFIX = "base_model.model."


def adapter_name(weight_name: str, part: str) -> str:
    """`X.weight` -> `X.adapter.lora_A` (part ADAPTER_A) or `X.adapter.lora_B`."""
    return weight_name[: -len("weight")] + part


def peft_name(hf_weight_name: str, matrix: str) -> str:
    """HF `model.layers.0.self_attn.q_proj.weight` -> peft's `base_model.model.model.layers.0.self_attn.q_proj.
    lora_A.weight` (matrix "lora_A" or "lora_B"; peft's saved names carry no adapter name)."""
    return PEFT_PREFIX + hf_weight_name[: -len("weight")] + matrix + ".weight"


def adapter_rules(
    cfg: HFModelConfig, linears: Sequence[str], pp_rank: int = 0, pp_size: int = 1, fused_norms: bool = False
) -> list[WeightRule]:
    """The adapter tensors of stage `pp_rank` whose base linears are named in `linears` (megatron names:
    linear_qkv, ...) as rules of the one mapping: rule.hf holds peft's names. A replicated A of a fused base
    lists each projection's name: merge_adapter copies it to each. Dense layers only (apply_lora refuses experts)."""
    rules = []
    for base in stage_rules(cfg, pp_rank, pp_size, fused_norms):
        linear = base.megatron.rsplit(".", 2)[-2]
        if base.expert or linear not in linears or not base.megatron.endswith(".weight"):
            continue
        a_names = tuple(peft_name(n, "lora_A") for n in base.hf)
        b_names = tuple(peft_name(n, "lora_B") for n in base.hf)
        column = base.kind in (QKV, FC1)
        rules += [
            WeightRule(adapter_name(base.megatron, ADAPTER_A), a_names, REPLICATED if column else base.kind),
            WeightRule(adapter_name(base.megatron, ADAPTER_B), b_names, base.kind if column else REPLICATED),
        ]
    return rules


def adapter_hf_shapes(cfg: HFModelConfig, linears: Sequence[str], rank: int) -> dict[str, tuple[int, ...]]:
    """peft's name -> shape of every adapter tensor (lora_A [r, in], lora_B [out, r] of each HF projection)."""
    shapes = hf_shapes(cfg)
    out = {}
    for base in stage_rules(cfg):
        if base.megatron.rsplit(".", 2)[-2] in linears and base.megatron.endswith(".weight") and not base.expert:
            for n in base.hf:
                rows, cols = shapes[n]
                out[peft_name(n, "lora_A")], out[peft_name(n, "lora_B")] = (rank, cols), (rows, rank)
    return out


def merge_adapter(rule: WeightRule, shards: Sequence[torch.Tensor], cfg: HFModelConfig) -> list[torch.Tensor]:
    """merge_shards for an adapter rule: a replicated A shared by a fused linear's projections goes to each."""
    merged = merge_shards(rule, shards, cfg)
    if rule.kind == REPLICATED and len(rule.hf) > 1:
        return [merged[0]] + [merged[0].clone() for _ in rule.hf[1:]]
    return merged


def with_adapter(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """state[name], or for an adapted linear's weight W + (alpha / r) B A, computed in float32 and returned in
    W's dtype (this rank's shard: with A or B split like W, the product is W's shard; no communication)."""
    w = state[name]
    b_name = adapter_name(name, ADAPTER_B) if name.endswith(".weight") else ""
    if b_name not in state:
        return w
    a, b = state[adapter_name(name, ADAPTER_A)], state[b_name]
    scale = getattr(b, LORA_SCALE, None)
    if scale is None:
        raise ValueError(
            f"{b_name} has no {LORA_SCALE}: pass the model's parameters (model_state(model)), not a copied state "
            "dict, to merge its LoRA adapters"
        )
    with torch.no_grad():
        return (w.detach().float() + scale * (b.detach().float() @ a.detach().float())).to(w.dtype)


def adapted_linears(state: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """The megatron linear names (linear_qkv, ...) that carry adapters in this stage's state."""
    suffix = "." + ADAPTER_A
    return tuple(sorted({k[: -len(suffix)].rsplit(".", 1)[-1] for k in state if k.endswith(suffix)}))


def gather_stage_adapter_weights(
    state: Mapping[str, torch.Tensor],
    cfg: HFModelConfig,
    tp_group=None,
    pp_rank: int = 0,
    pp_size: int = 1,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (peft name, full tensor) for every adapter tensor of PP stage `pp_rank` (collective over TP), in
    adapter_rules' order; as gather_stage_hf_weights for the base's."""
    state = {strip_wrapper_prefix(k): v for k, v in state.items()}
    for rule in adapter_rules(cfg, adapted_linears(state), pp_rank, pp_size, uses_fused_norms(state)):
        shard = state[rule.megatron]
        for name, t in zip(rule.hf, merge_adapter(rule, _gather(shard, tp_group), cfg)):
            yield name, t.to(dtype or shard.dtype)


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """All-gather of one tensor over `group` (None or size 1: the tensor alone), on its own device."""
    t = t.detach()
    if group is None or group.size() == 1:
        return [t]
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(out, t, group=group)
    return out


def strip_wrapper_prefix(name: str) -> str:
    """A parameter name without wrapper prefixes (DDP's `module.`)."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name
