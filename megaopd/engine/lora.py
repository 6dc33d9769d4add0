"""An adapter update for the embedded engine: LoRA tensors in peft's names, merged into the engine's weights.

    update = AdapterUpdate.of(peft_named_tensors, rank=16, alpha=32, version="lora-step-7")
    runner.update_adapter(update)        # generates with W + (alpha / r) B A from now on

A LoRA student's sync can send its adapters alone (megaopd.models.gather.gather_adapter_weights names them as
peft does: base_model.model.<HF module>.lora_A.weight [r, in] and .lora_B.weight [out, r]): r (in + out) numbers
per adapted projection instead of in * out. The embedded engine merges them into its weights, in float32 math
from a kept copy of the base (AdapterMerge), so each update is the base plus the new adapter, never an
accumulation of rounded merges, and a projection the new adapter leaves out goes back to its base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

PEFT_PREFIX = "base_model.model."
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


@dataclass(frozen=True)
class AdapterUpdate:
    """One adapter sync: per HF weight name its (A [r, in], B [out, r]), the scale alpha / r, a version name."""

    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    """HF weight name (model.layers.0.self_attn.q_proj.weight) -> (lora_A, lora_B)."""
    scale: float
    version: str

    @classmethod
    def of(cls, tensors: Iterable[tuple[str, torch.Tensor]], rank: int, alpha: float, version: str) -> AdapterUpdate:
        """From peft-named tensors; AdapterError (one line per problem) when a name is not peft's LoRA name, an A
        lacks its B (or the reverse), a shape does not fit rank, or a value is not finite."""
        if rank < 1 or not (alpha > 0 and math.isfinite(alpha)):
            raise AdapterError(f"adapter update {version!r}: rank={rank}, alpha={alpha}: rank >= 1, alpha > 0")
        parts: dict[str, dict[str, torch.Tensor]] = {}
        problems = []
        for name, t in tensors:
            if not name.startswith(PEFT_PREFIX) or not name.endswith((LORA_A, LORA_B)):
                problems.append(f"{name}: not a peft LoRA name (base_model.model.<module>.lora_A|lora_B.weight)")
                continue
            matrix = "A" if name.endswith(LORA_A) else "B"
            base = name[len(PEFT_PREFIX) : -len(LORA_A)] + ".weight"
            if matrix in parts.setdefault(base, {}):
                problems.append(f"{name}: sent twice")
            parts[base][matrix] = t
        pairs = {}
        for base, got in parts.items():
            if set(got) != {"A", "B"}:
                problems.append(f"{base}: lora_{'B' if 'A' in got else 'A'} missing")
                continue
            a, b = got["A"], got["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
                problems.append(f"{base}: lora_A {list(a.shape)}, lora_B {list(b.shape)} do not fit rank {rank}")
            elif not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                problems.append(f"{base}: the adapter holds non-finite values")
            else:
                pairs[base] = (a, b)
        if problems:
            raise AdapterError(
                f"adapter update {version!r}: {len(problems)} problem(s), nothing was loaded:\n  "
                + "\n  ".join(problems)
            )
        return cls(pairs, alpha / rank, str(version))

    def nbytes(self) -> int:
        """What the update moves: the adapter tensors' bytes."""
        return sum(t.numel() * t.element_size() for a, b in self.pairs.values() for t in (a, b))


class AdapterError(ValueError):
    """An adapter update that cannot be loaded; the message lists every problem; nothing was loaded."""


class AdapterMerge:
    """The base values of the weights an adapter changed (on the CPU, in the engine's dtype: exact), so the next
    update merges into the base again and a weight left out returns to it."""

    def __init__(self):
        self.base: dict[str, torch.Tensor] = {}

    def merged(self, name: str, current: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor], scale: float):
        """The weight `name` as W_base + scale * B A, computed in float32 and returned in current's dtype."""
        base = self.base.setdefault(name, current.detach().to("cpu", copy=True))
        a, b = (t.to(device=current.device, dtype=torch.float32) for t in pair)
        return (base.to(device=current.device, dtype=torch.float32) + scale * (b @ a)).to(current.dtype)

    def restore(self, keep: Iterable[str]) -> dict[str, torch.Tensor]:
        """The base values of the adapted weights not in `keep` (to load back), forgotten here."""
        keep = set(keep)
        return {n: self.base.pop(n) for n in [n for n in self.base if n not in keep]}

    def forget(self, names: Iterable[str]) -> None:
        """Weights loaded whole (a full sync): their new values are the base from now on."""
        for n in names:
            self.base.pop(n, None)
