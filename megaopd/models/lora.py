"""Low-rank adapters (LoRA) on megatron-core's tensor-parallel linears, sharded with the base at any TP.

    names = apply_lora(model, LoRAConfig(enabled=True, rank=16, alpha=32, targets=["all"]), pgs.tp)
    with adapters_off(model):            # the frozen base's outputs, bit for bit: the reference for free
        ref = model(...)

A targeted linear computes `W x + (alpha / r) B A dropout(x)`; B starts at zero (the model starts as its base),
A uniform in +-1/sqrt(in) (peft's kaiming init), drawn whole from a generator seeded by the layer's name and
then sliced, so every TP layout starts from the same adapter. The base (every parameter that is not an
adapter) is frozen.

Sharding (the base linear's layout decides the adapter's; megatron-core 0.16 has no LoRA of its own):
- column-parallel base W [out/tp, in] (linear_qkv, linear_fc1): A [r, in] replicated, B [out/tp, r] split on
  dim 0 like W's rows. x is whole on every TP rank; h = A x is the same on every rank; y_shard = B_shard h.
  Backward: each rank's dh = B_shard^T g_shard is partial, so h passes through megatron's
  copy_to_tensor_model_parallel_region (identity forward, all-reduce of dh backward: r numbers per token).
  Then dA = dh x^T and dx = A^T dh are whole and equal on every TP rank, as a replicated A needs.
- row-parallel base W [out, in/tp] (linear_proj, linear_fc2): A [r, in/tp] split on dim 1 like W's columns,
  B [out, r] replicated. h = all-reduce(A_shard x_shard) (reduce_from_tensor_model_parallel_region: identity
  backward), y = B h, added to the base's output after the base's own all-reduce. Reducing h (r wide) rather
  than adding B A_shard x_shard into the base's partial sums before its reduce gives the same y with the
  replicated B's gradient whole on every rank (the other way B's gradient would be a partial sum needing a
  TP all-reduce of its own), for one extra all-reduce of r numbers per token.
The shards carry megatron's tensor_model_parallel attributes (gradient-norm counting, checkpoint sharding):
the base linear's sharded_state_dict is extended with the adapter's split axis.

Where LoRA cannot go yet, apply_lora refuses in one line: MoE expert linears (megatron's SequentialMLP
experts: their TP/EP communication is explicit), Transformer Engine linears (build with use_te=False; TE's
LayerNormColumnParallelLinear fuses the norm into the linear, so its input is not the adapter's input) and
sequence parallelism (the input is split along the sequence).
"""

from __future__ import annotations

import contextlib
import math
import re
import types
import zlib
from typing import Iterator

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megaopd.models.config import LORA_TARGETS, LoRAConfig
from megaopd.models.weights import LORA_SCALE

COLUMN, ROW = "column", "row"
MEGATRON_LINEARS = {"qkv": "linear_qkv", "proj": "linear_proj", "fc1": "linear_fc1", "fc2": "linear_fc2"}
"""A LoRA target -> the megatron linear it adapts (module name's last part)."""
PARALLEL = {"linear_qkv": COLUMN, "linear_fc1": COLUMN, "linear_proj": ROW, "linear_fc2": ROW}
ADAPTER = "adapter"
"""The adapter's child name under its base linear: its parameters are `<base>.adapter.lora_A` / `.lora_B`, the
base's own names (`<base>.weight`) unchanged, so the HF mapping, loads and checkpoints of the base still hold."""


def target_linears(targets) -> tuple[str, ...]:
    """The megatron linear names of a config's targets ("all": the four)."""
    chosen = LORA_TARGETS[:-1] if "all" in targets else tuple(t for t in LORA_TARGETS if t in targets)
    return tuple(MEGATRON_LINEARS[t] for t in chosen)


class LoRAAdapter(torch.nn.Module):
    """The low-rank update of one tensor-parallel linear (this rank's shards of A and B)."""

    def __init__(self, base: torch.nn.Module, kind: str, rank: int, alpha: float, dropout: float, seed: int, tp_group):
        super().__init__()
        self.kind, self.rank, self.scale = kind, rank, alpha / rank
        self.tp_group = tp_group
        self.dropout = dropout
        self.enabled = True
        self.swiglu = False
        """B is a gated linear_fc1's [gate; up] rows (its checkpoint entry needs megatron's SwiGLU factory)."""
        tp, tp_rank = tp_group.size(), tp_group.rank()
        w = base.weight
        in_full, out_full = base.input_size, base.output_size
        # The whole A from one generator seeded by the layer (a TP-independent start), then this rank's slice.
        gen = torch.Generator().manual_seed(seed)
        a = torch.empty(rank, in_full, dtype=torch.float32).uniform_(-1.0, 1.0, generator=gen) / math.sqrt(in_full)
        if kind == COLUMN:
            a_shard, b_shape = a, (out_full // tp, rank)
        else:
            a_shard, b_shape = a.chunk(tp, dim=1)[tp_rank], (out_full, rank)
        self.lora_A = torch.nn.Parameter(a_shard.to(device=w.device, dtype=w.dtype).contiguous())
        self.lora_B = torch.nn.Parameter(torch.zeros(b_shape, device=w.device, dtype=w.dtype))
        setattr(self.lora_B, LORA_SCALE, self.scale)  # what merging a state of parameters needs (weights.py)
        # megatron counts a split tensor's gradient norm on every TP rank, a replicated one on rank 0 only.
        if kind == COLUMN:
            set_tensor_model_parallel_attributes(self.lora_B, True, 0, 1)
        else:
            set_tensor_model_parallel_attributes(self.lora_A, True, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout > 0:
            # The default generator: the same mask on every TP rank (megatron seeds it equally over TP), which a
            # column base's replicated input needs so that h = A x stays equal across ranks.
            x = F.dropout(x, self.dropout, training=True)
        h = F.linear(x, self.lora_A)
        if self.kind == COLUMN:
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, self.lora_B) * self.scale

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """This rank's shard of scale * B A in float32 (the merged weight's difference from the base)."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scale


def _add_adapter(module, args, kwargs, output):
    """Forward hook of an adapted linear: output (y, bias) -> (y + adapter(x), bias)."""
    adapter = getattr(module, ADAPTER)
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    y, bias = output
    return y + adapter(x).to(y.dtype), bias


def _sharded_state_dict_with_adapter(self, prefix="", sharded_offsets=(), metadata=None):
    """The base linear's checkpoint entries plus its adapter's, split on the axis the adapter is split on
    (megatron's own method would save a split adapter tensor as if replicated). A gated MLP's linear_fc1 holds
    [gate shard; up shard] on each TP rank: its B is saved through megatron's SwiGLU factory, as megatron's MLP
    saves the weight, so a checkpoint loads at another TP (as plain row shards, TP=2 -> 1 read
    [gate_0; up_0; gate_1; up_1] as [gate; up]: tests/models/test_lora.py caught it)."""
    axes = {"weight": 0, "bias": 0} if self.adapter.kind == COLUMN else {"weight": 1}
    axes.update({f"{ADAPTER}.lora_B": 0} if self.adapter.kind == COLUMN else {f"{ADAPTER}.lora_A": 1})
    out = make_sharded_tensors_for_checkpoint(
        self.state_dict(prefix="", keep_vars=True),
        prefix,
        axes,
        sharded_offsets,
        tp_group=self.tp_group,
        dp_cp_group=metadata["dp_cp_group"],
    )
    if self.adapter.swiglu:
        key = f"{prefix}{ADAPTER}.lora_B"
        singleton = (metadata or {}).get("singleton_local_shards", False)
        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
    return out


def _refusal(name: str, module: torch.nn.Module, kind: str) -> str | None:
    if ".experts." in name:
        return (
            f"LoRA on MoE expert linears ({name}) is not supported: set student.lora.targets to [qkv, proj] "
            "for a MoE student"
        )
    expected = ColumnParallelLinear if kind == COLUMN else RowParallelLinear
    if type(module) is not expected:
        return (
            f"LoRA needs megatron's local {expected.__name__} at {name}, not {type(module).__name__} "
            "(Transformer Engine's fused layers): build the student with use_te=False"
        )
    if getattr(module, "sequence_parallel", False):
        return f"LoRA with sequence_parallel ({name}) is not supported: set student.sequence_parallel=false"
    if kind == COLUMN and module.gather_output:
        return f"LoRA on a column-parallel linear that gathers its output ({name}) is not supported"
    if kind == ROW and not module.input_is_parallel:
        return f"LoRA on a row-parallel linear whose input is not split ({name}) is not supported"
    return None


def last_name(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def global_name(name: str, layer_offset: int) -> str:
    """A stage's module name with its layer index made global (decoder.layers.i -> i + layer_offset)."""
    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig, tp_group, seed: int = 0, layer_offset: int = 0) -> list[str]:
    """Adds adapters to the targeted linears of this rank's model stage, freezes everything else, and returns
    the adapted linears' names. Raises ValueError (one line) before changing anything when a target cannot
    take an adapter. tp_group: the model's TP group (the adapters' collectives run on it); layer_offset: the
    stage's first layer (A's initial values are seeded by the global layer name, the same at any TP and PP)."""
    wanted = target_linears(cfg.targets)
    chosen = []
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last not in wanted:
            continue
        kind = PARALLEL[last]
        why = _refusal(name, module, kind)
        if why:
            raise ValueError(why)
        chosen.append((name, module, kind))
    if not chosen:
        raise ValueError(f"student.lora.targets={list(cfg.targets)} matched no linear of the model")
    model.requires_grad_(False)
    for name, module, kind in chosen:
        layer_seed = seed + zlib.crc32(global_name(name, layer_offset).encode())
        adapter = LoRAAdapter(module, kind, cfg.rank, cfg.alpha, cfg.dropout, layer_seed, tp_group)
        # megatron's MLP saves a gated linear_fc1's weight through its SwiGLU factory; the adapter's B follows
        adapter.swiglu = last_name(name) == "linear_fc1" and bool(getattr(module.config, "gated_linear_unit", False))
        module.add_module(ADAPTER, adapter)
        module.register_forward_hook(_add_adapter, with_kwargs=True)
        module.sharded_state_dict = types.MethodType(_sharded_state_dict_with_adapter, module)
    return [name for name, _, _ in chosen]


def adapters(model: torch.nn.Module) -> Iterator[tuple[str, LoRAAdapter]]:
    """(name of the adapted linear, its adapter) for every adapter in the model, in module order."""
    for name, module in model.named_modules():
        if isinstance(module, LoRAAdapter):
            yield name.rsplit(".", 1)[0], module


def has_adapters(model: torch.nn.Module) -> bool:
    return next(adapters(model), None) is not None


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """Inside the block the model computes its frozen base exactly (the adapters' hooks return the base's
    outputs untouched): the reference model's log-probs from the student itself."""
    found = [a for _, a in adapters(model)]
    before = [a.enabled for a in found]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a, was in zip(found, before):
            a.enabled = was


def lora_meta(model: torch.nn.Module) -> dict | None:
    """The adapters' settings as a checkpoint's metadata records them (a LoRAConfig's fields; None without
    adapters): a converter rebuilds the adapters from them before loading the checkpoint."""
    found = list(adapters(model))
    if not found:
        return None
    linears = sorted({name.rsplit(".", 1)[-1] for name, _ in found})
    a = found[0][1]
    targets = [t for t, linear in MEGATRON_LINEARS.items() if linear in linears]
    return dict(enabled=True, rank=a.rank, alpha=a.scale * a.rank, targets=targets, dropout=a.dropout)


def adapter_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trained parameters of a LoRA model (what the optimizer holds)."""
    return [p for _, a in adapters(model) for p in (a.lora_A, a.lora_B)]
