"""Transport "in_process": engines living in the trainer's rank-0 process load the tensors directly.

    InProcessTransport([embedded_engine]).push(hf_named_tensors, weight_version="7")

The embedded engine copies each full HF-named tensor into its model by name (update_weights: all or
nothing, names and shapes checked first). No bytes leave the process and no group is formed. A LoRA student's
adapter sync (rollout.lora_sync=adapter) hands the peft-named adapter tensors to update_adapter_weights
instead: the engine merges them into the base it keeps (megaopd.engine.lora).
"""

from __future__ import annotations

from typing import Iterable

import torch

from megaopd.sync.transport import AdapterMeta, TransportKind, TransportSetup


class InProcessTransport:
    name = "in_process"
    all_ranks = False
    """Only trainer rank 0, where the engine lives, loads."""

    def __init__(self, engines: list):
        """engines: objects with update_weights(named_tensors, weight_version) ("in_process" accepted)."""
        if not engines:
            raise ValueError("InProcessTransport needs at least one engine")
        self.engines = list(engines)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        # One engine streams the tensors; several each need the whole list.
        named = named_tensors if len(self.engines) == 1 else list(named_tensors)
        for engine in self.engines:
            engine.update_weights(named, weight_version=weight_version)

    def push_adapter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], meta: AdapterMeta, weight_version: str | None
    ) -> None:
        """engines: objects with update_adapter_weights(named_tensors, rank, alpha, weight_version)."""
        named = list(named_tensors)  # an adapter is small (about 1% of the weights): each engine reads the list
        for engine in self.engines:
            engine.update_adapter_weights(named, meta.rank, meta.alpha, weight_version=weight_version)

    def close(self) -> None:
        pass


def _build(setup: TransportSetup) -> InProcessTransport:
    return InProcessTransport(setup.targets)


KIND = TransportKind("in_process", _build, adapters=True)
"""Engines in this process, colocated or not: nothing to send, so always first when an engine accepts it."""
