"""What a weight transport is to WeightSync: its kind (when it fits, who sends, how it is built) and what
it is built from. The kinds in use, in order of preference, are one ordered table: weight_sync.TRANSPORT_KINDS.

A new transport is one module in megaopd/sync (its class with push/close and its KIND) and one entry in
TRANSPORT_KINDS (docs/extending.md); WeightSync picks and builds transports through their kinds only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import torch

from megaopd.rollout.config import RolloutConfig

if TYPE_CHECKING:
    from megaopd.sync.cuda_ipc import IpcLayout


class Transport(Protocol):
    """One way of handing HF-named tensors to engines."""

    name: str
    all_ranks: bool
    """Every trainer rank calls push (the gather gives each rank all tensors); else trainer rank 0 only."""

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class AdapterMeta:
    """What an adapter update needs besides its peft-named tensors: the adapters' rank and alpha (the engine
    merges W + (alpha / rank) B A). From the actor: models.lora.lora_meta."""

    rank: int
    alpha: float


class AdapterTransport(Transport, Protocol):
    """A transport whose kind has `adapters`: it also hands peft-named LoRA tensors to engines."""

    def push_adapter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], meta: AdapterMeta, weight_version: str | None
    ) -> None: ...


@dataclass(frozen=True)
class TransportSetup:
    """What one rank builds its transport from, at the first push."""

    targets: list | None
    """Rank 0: the engines (weight targets) this transport serves; None on the other ranks."""
    rollout: RolloutConfig
    rank: int
    group: Any
    """The trainer's ranks that push together (None: torch's default group)."""
    decision: Any = None
    """What the kind's `decide` returned on rank 0, broadcast to every rank (None when it decides nothing)."""

    @property
    def bucket_bytes(self) -> int:
        return self.rollout.weight_sync_bucket_mb << 20


@dataclass(frozen=True)
class TransportKind:
    """A transport as WeightSync picks and builds it."""

    name: str
    """The name engines list in `weight_transports` (megaopd.rollout.protocol)."""
    build: Callable[[TransportSetup], Transport]
    colocated: bool | None = None
    """The engines it serves: True colocated ones only, False ones on their own GPUs only, None either."""
    all_ranks: bool = False
    """Built and pushed on every trainer rank; else on rank 0 only."""
    alone: bool = False
    """Cannot share a push with another transport (every rank runs its collectives in step)."""
    decide: Callable[[list, IpcLayout], Any] | None = None
    """Rank 0, at the first push: what every rank needs to build it (its targets and the trainer's layout in),
    broadcast as TransportSetup.decision."""

    adapters: bool = False
    """Its transport also takes LoRA adapter updates (push_adapter; rollout.lora_sync=adapter): the engines it
    serves merge the adapter into the base weights they keep."""

    def fits(self, colocated: bool) -> bool:
        return self.colocated is None or self.colocated == colocated
