"""HF-named weights -> the model's tensors: the names the embedded engine loads, and where each lands.

Weights are named as in the HF checkpoint (what megaopd's gather and SGLang send). transformers 5 keeps a
MoE layer's experts fused (Qwen3-MoE's mlp.experts.gate_up_proj / down_proj); a per-expert name such as
mlp.experts.3.gate_proj.weight loads into its slice of the fused tensor (fused_expert_slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class WeightSlot:
    """Where one HF-named tensor lives in the model: a module tensor, or a slice of a fused one."""

    param: str
    """The model's state_dict name."""
    index: tuple | None = None
    """Index into that tensor (None: the whole tensor)."""

    @property
    def key(self) -> tuple:
        """Hashable identity of the slice (slices are not hashable before Python 3.12)."""
        if self.index is None:
            return ()
        return tuple((i.start, i.stop) if isinstance(i, slice) else i for i in self.index)


_FUSED_GATE_UP, _FUSED_DOWN = "experts.gate_up_proj", "experts.down_proj"


def fused_expert_slots(params: dict[str, torch.Tensor]) -> dict[str, WeightSlot]:
    """HF name -> WeightSlot for every loadable tensor of a transformers model.

    transformers 5 keeps a MoE layer's experts fused (Qwen3-MoE: `mlp.experts.gate_up_proj` [E, 2F, H],
    whose expert e is [gate_proj (F rows); up_proj (F rows)], as Qwen3MoeExperts.forward chunks it, and
    `mlp.experts.down_proj` [E, H, F]), while checkpoints, SGLang and megaopd's weight sync name each
    expert: `mlp.experts.{e}.gate_proj.weight` [F, H], `up_proj.weight` [F, H], `down_proj.weight` [H, F].
    Those per-expert names map to slices of the fused tensors; every other name maps to itself.
    """
    slots: dict[str, WeightSlot] = {}
    for name, t in params.items():
        if name.endswith(_FUSED_GATE_UP) and t.dim() == 3:
            prefix, F = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                slots[f"{prefix}{e}.gate_proj.weight"] = WeightSlot(name, (e, slice(0, F)))
                slots[f"{prefix}{e}.up_proj.weight"] = WeightSlot(name, (e, slice(F, 2 * F)))
        elif name.endswith(_FUSED_DOWN) and t.dim() == 3:
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                slots[f"{prefix}{e}.down_proj.weight"] = WeightSlot(name, (e,))
        else:
            slots[name] = WeightSlot(name)
    return slots


class WeightMismatchError(ValueError):
    """update_weights got names the model lacks or shapes that differ; nothing was loaded."""


class WeightTable:
    """The HF names a model loads, their shapes, and the tensor (or slice) each one writes into."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = params
        """Module name -> Parameter / buffer (state_dict(keep_vars=True): tied names alias one tensor)."""
        self.slots = fused_expert_slots(params)
        self.specs = {n: (tuple(self.view(n).shape), self.view(n).dtype) for n in self.slots}
        """HF name -> (shape, dtype), read once at start-up (a discarded weight has no shape until restored)."""
        first: dict[tuple[int, tuple], str] = {}
        self.canonical = {n: first.setdefault((id(params[s.param]), s.key), n) for n, s in self.slots.items()}
        """HF name -> the first name of the same tensor slice (tied aliases share one entry)."""

    def view(self, name: str) -> torch.Tensor:
        """The model tensor (or the slice of a fused expert tensor) that HF name `name` loads into, resolved
        now: offload and discard replace the parameters' storage, so views are never kept."""
        slot = self.slots[name]
        t = self.params[slot.param]
        return t[slot.index] if slot.index is not None else t

    def problems(self, named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Problems (unknown names, shape mismatches, duplicates) that would stop a load; [] when fine."""
        problems, seen = [], set()
        for name, shape in named_shapes:
            shape = tuple(int(s) for s in shape)
            if name in seen:
                problems.append(f"{name}: sent twice")
            seen.add(name)
            if name not in self.specs:
                problems.append(f"{name}: no such weight in the model")
            elif self.specs[name][0] != shape:
                problems.append(f"{name}: shape {list(shape)} != model's {list(self.specs[name][0])}")
        return problems

    def check(self, named_shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        """WeightMismatchError listing every problem of a load, before anything is loaded."""
        problems = self.problems(named_shapes)
        if problems:
            raise WeightMismatchError(
                f"update_weights: {len(problems)} of {len(named_shapes)} tensors do not match the model "
                f"({len(self.slots)} weights, HF names such as {next(iter(self.slots))!r}); nothing was "
                "loaded:\n  " + "\n  ".join(problems)
            )
