"""This rank's Megatron shards -> full HF-named tensors: the TP (and EP) all-gather and the PP collection.

    tensors = gather_hf_weights(model_state(model), hf_cfg, pgs.tp, pgs.pp, ep_group=pgs.ep)  # collective, lazy
    for name, t in tensors: ...                                                               # every rank drains it

The mapping itself (which megatron tensor is made of which HF tensors, and how shards merge) is the
one in megaopd.models.weights (stage_rules, merge_shards), shared with the checkpoint converters; each
stage's tensors come from models.weights.gather_stage_hf_weights (TP, and for a MoE model's experts EP);
this module adds the PP collection. Every collective tensor lives on the device of the shard it came from
(the model's device), which is the device of the group's backend: CUDA under NCCL, CPU under gloo.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from megaopd.models.hf_config import HFModelConfig
from megaopd.models.weights import (
    adapted_linears,
    adapter_hf_shapes,
    adapter_rules,
    gather_stage_adapter_weights,
    gather_stage_hf_weights,
    hf_shapes,
    model_state,
    stage_rules,
    strip_wrapper_prefix,
    uses_fused_norms,
)

__all__ = ["gather_adapter_weights", "gather_hf_weights", "model_state", "stage_hf_names"]


def stage_hf_names(cfg: HFModelConfig, pp_rank: int, pp_size: int, fused_norms: bool, ep_size: int = 1) -> list[str]:
    """The HF names of stage `pp_rank` in the order gather_stage_hf_weights yields them: rule by rule,
    and for an expert rule's slot each of its HF tensors over the EP ranks in turn."""
    per_ep = [stage_rules(cfg, pp_rank, pp_size, fused_norms, e, ep_size) for e in range(ep_size)]
    names: list[str] = []
    for i, rule in enumerate(per_ep[0]):
        if not rule.export:
            continue
        if not rule.expert:
            names += rule.hf
        else:
            names += [per_ep[e][i].hf[k] for k in range(len(rule.hf)) for e in range(ep_size)]
    return names


def gather_hf_weights(
    state: Mapping[str, torch.Tensor],
    cfg: HFModelConfig,
    tp_group=None,
    pp_group=None,
    collect_pp: bool = True,
    dtype: torch.dtype | None = None,
    ep_group=None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, full tensor) for the whole model, built from every rank's megatron shard.

    state: this rank's megatron tensors by name (model_state(model), or a state_dict; a `module.`
    prefix is ignored). tp_group: this stage's TP group (None = TP 1); pp_group: this rank's pipeline
    group (None = PP 1); ep_group: this rank's expert-parallel group (None = EP 1; a MoE model at EP > 1
    holds only its experts, gathered over EP as well). Collective: every rank of the three groups must
    consume the whole iterator.
    With collect_pp (default) every rank receives every tensor: each stage all-gathers its shards over
    TP, then broadcasts them over the PP group, one tensor at a time (memory: one tensor at a time).
    With collect_pp=False only this stage's tensors are yielded (no PP traffic): a weight-sync sender
    per stage can stream them directly. Tensors are detached copies, all in one dtype: `dtype`, or by
    default that of the linear weights (megatron's local-spec norms are float32 even in a bf16 model;
    HF stores every tensor in the model dtype, and the PP broadcast needs one dtype on all ranks).
    A model with LoRA adapters (models/lora.py) yields its merged weights W + (alpha / r) B A (weights.with_adapter:
    float32 math, each shard merged where it lies), so every weight sync and export of it is the trained student.
    """
    state = {strip_wrapper_prefix(k): v for k, v in state.items()}
    fused = uses_fused_norms(state)
    pp_rank = pp_group.rank() if pp_group is not None else 0
    pp_size = pp_group.size() if pp_group is not None else 1
    ep_size = ep_group.size() if ep_group is not None else 1
    some = state["decoder.layers.0.self_attention.linear_qkv.weight"]  # every stage has a layer 0
    dtype = dtype or some.dtype

    def local() -> Iterator[tuple[str, torch.Tensor]]:
        return gather_stage_hf_weights(state, cfg, tp_group, ep_group, pp_rank, pp_size, dtype)

    if pp_size == 1 or not collect_pp:
        yield from local()
        return
    shapes = hf_shapes(cfg)
    names = [stage_hf_names(cfg, stage, pp_size, fused, ep_size) for stage in range(pp_size)]
    yield from _collect_pp(local, names, shapes, dtype, some.device, pp_group)


def gather_adapter_weights(
    state: Mapping[str, torch.Tensor],
    cfg: HFModelConfig,
    tp_group=None,
    pp_group=None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (peft name, full tensor) of every LoRA adapter tensor of the whole model on every rank (a model
    with adapters, models/lora.py): gathered over TP by the one mapping (weights.adapter_rules), collected over
    PP as gather_hf_weights does. Collective over both groups; dense models (apply_lora refuses experts)."""
    state = {strip_wrapper_prefix(k): v for k, v in state.items()}
    linears = adapted_linears(state)
    if not linears:
        raise ValueError("the model has no LoRA adapters to export (student.lora.enabled=false?)")
    pp_rank = pp_group.rank() if pp_group is not None else 0
    pp_size = pp_group.size() if pp_group is not None else 1
    some = next(v for k, v in state.items() if k.endswith(".lora_A"))
    dtype = dtype or some.dtype

    def local() -> Iterator[tuple[str, torch.Tensor]]:
        return gather_stage_adapter_weights(state, cfg, tp_group, pp_rank, pp_size, dtype)

    if pp_size == 1:
        yield from local()
        return
    fused = uses_fused_norms(state)
    names = [[n for r in adapter_rules(cfg, linears, s, pp_size, fused) for n in r.hf] for s in range(pp_size)]
    shapes = adapter_hf_shapes(cfg, linears, some.shape[0])
    yield from _collect_pp(local, names, shapes, dtype, some.device, pp_group)


def _collect_pp(local, names: list[list[str]], shapes, dtype, device, pp_group) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's tensors on every rank of pp_group: stage by stage, each tensor broadcast from its stage
    (names[stage] in the order its local() yields them; one tensor in memory at a time)."""
    pp_rank = pp_group.rank()
    for stage, stage_names in enumerate(names):
        src = dist.get_global_rank(pp_group, stage)
        mine = local() if stage == pp_rank else None
        for name in stage_names:
            if mine is not None:
                got_name, t = next(mine)
                assert got_name == name, (got_name, name)
            else:
                t = torch.empty(shapes[name], dtype=dtype, device=device)
            dist.broadcast(t, src=src, group=pp_group)
            yield name, t
