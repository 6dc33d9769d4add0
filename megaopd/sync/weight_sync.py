"""The trainer's one entry point to weight sync: actor shards -> HF-named tensors -> every engine.

    sync = WeightSync(engine if rank == 0 else None, cfg.rollout, rank)   # once, not collective
    stats = sync.push(actor_model, actor_hf_cfg, actor_pgs, weight_version=str(step))  # every rank
    sync.close()

push() is collective over `group` (default: torch's default group) and the actor's TP/PP groups:
    1. the choice (first push only): rank 0 picks one transport per engine from what the engine accepts
       (engine.weight_transports) and the config (choose_transport over TRANSPORT_KINDS), and tells every
       rank which transports are in use and what their kinds decided (cuda_ipc: which ranks feed which
       engine GPU); each rank builds the transports its kinds run on (all ranks, or rank 0);
    2. colocated engines: every rank empties its CUDA cache (the trainer's cached blocks would leave
       the engines too little memory), then rank 0 resumes "weights" on the engines that released them;
    3. gather (megaopd.models.gather: over TP, over EP for a MoE actor's experts, then PP) and send (the transports);
    ranks that send nothing drain the gather. A LoRA student whose syncs send adapters (rollout.lora_sync=adapter,
    or auto when every engine's transport takes them: the embedded engine, megaopd serve; decided at the first
    push with the transports, TransportChoice.adapters) sends its adapters alone (gather_adapter_weights, peft
    names; the transport's push_adapter), after the base weights on the first push (the engines merge every
    adapter into the base they keep, so it must be the actor's) and on every push to colocated engines (which
    drop their weights while the actor trains); lora_sync=merged (or a LoRA-less student) sends every weight, an
    adapted one as W + (alpha / r) B A (float32 math);
    4. colocated engines: rank 0 resumes "kv_cache" and "cuda_graph" where released (SGLang's order
       after training: weights first, then the KV cache, so the two never compete for memory);
    5. a barrier (an all-reduce of "abandoned"): no rank runs ahead while the engines still load.
Only tags an engine released are resumed (SGLang 0.5.23 dies on a resume without a release), so the
first push at start-up, before any release, resumes nothing.

A preemption signal during a push: rank 0's waits on the engines end with WaitAbandoned (the engines'
stop callback, megaopd.rollout.waits); rank 0 still drains the gather (the other ranks are in it), and
the barrier tells every rank, which all raise WaitAbandoned together: the trainer then checkpoints.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from megaopd.models.gather import gather_adapter_weights, gather_hf_weights, model_state
from megaopd.models.lora import lora_meta
from megaopd.models.weights import ADAPTER_A, ADAPTER_B
from megaopd.parallel.dist import device
from megaopd.rollout.config import ADAPTER_SYNC, RolloutConfig
from megaopd.rollout.waits import WaitAbandoned
from megaopd.sync import cuda_ipc, distributed, http_lora, in_process
from megaopd.sync.cuda_ipc import IpcLayout
from megaopd.sync.transport import AdapterMeta, TransportKind, TransportSetup

TRANSPORT_KINDS: dict[str, TransportKind] = {
    k.name: k for k in (in_process.KIND, distributed.KIND, cuda_ipc.KIND, http_lora.KIND)
}
"""Every weight transport, in order of preference (the first one an engine accepts and that fits
rollout.colocated is used; a sync of LoRA adapters alone prefers those whose kind takes `adapters`): a new
transport is its module and one entry here (docs/extending.md)."""
TRANSPORTS = tuple(TRANSPORT_KINDS)


def choose_transport(accepted: Iterable[str], colocated: bool, adapters: bool = False) -> str:
    """The transport for one engine: the first kind of TRANSPORT_KINDS it accepts that fits `colocated`
    (in-process when it lives here; else CUDA IPC when colocated, NCCL refusing a group with two ranks
    on one GPU, the weight-update group otherwise); with `adapters` (a LoRA sync of the adapters alone), the
    first such kind that takes adapters, else the first of any."""
    accepted = tuple(accepted)
    fitting = [k.name for k in TRANSPORT_KINDS.values() if k.fits(colocated)]
    preferred = [n for n in fitting if TRANSPORT_KINDS[n].adapters] if adapters else []
    for name in preferred + fitting:
        if name in accepted:
            return name
    raise ValueError(
        f"engine accepts weight transports {list(accepted)}, none of {fitting} (the transports for "
        f"rollout.colocated={str(colocated).lower()}): fix rollout.colocated or the engine"
    )


@dataclass
class TransportChoice:
    """What rank 0 decided at the first push and every rank follows."""

    transports: list[str]
    """Transport names in use (one or more; a kind marked `alone` only alone)."""
    adapters: bool = False
    """A LoRA student's syncs send the adapters alone (after the base, once): rollout.lora_sync=adapter, or auto
    when every engine's transport takes adapters (embedded, megaopd serve; SGLang engines take merged weights)."""
    decisions: dict[str, Any] = field(default_factory=dict)
    """Per transport name, what its kind's `decide` returned on rank 0 (cuda_ipc: the feeder ranks)."""


@dataclass
class SyncStats:
    """One push, as rank 0 saw it."""

    seconds: float
    tensors: int
    bytes: int
    """Every byte the push sent (an adapter push's first: the base too)."""
    transports: list[str]
    adapter_bytes: int = 0
    """Of `bytes`, the LoRA adapter tensors' (rollout.lora_sync=adapter; 0 when every weight was sent merged)."""


class WeightSync:
    def __init__(
        self,
        engine,
        rollout: RolloutConfig,
        rank: int,
        group=None,
        local_world_size: int | None = None,
        engines_per_node: int = 1,
    ):
        """engine: the rollout engine (or pool) on rank 0, None on the other ranks. group: the trainer's
        ranks that push together (None: torch's default group). Only colocated engines use the rest:
        local_world_size, trainer ranks per node (default: torchrun's LOCAL_WORLD_SIZE, else the visible
        GPU count); engines_per_node, engines sharing a node in rollout.urls order."""
        if rank == 0 and engine is None:
            raise ValueError("WeightSync on rank 0 needs the engine")
        self.engine, self.rollout, self.rank, self.group = engine, rollout, rank, group
        self.local_world_size, self.engines_per_node = local_world_size, engines_per_node
        self.choice: TransportChoice | None = None
        self.transports: list = []
        self.base_sent = False
        self._sent = (0, 0)  # tensors and bytes of this push's full-weight sends so far (rank 0's stats)
        """rollout.lora_sync=adapter: the engines hold the actor's base weights (sent by the first push)."""

    # -------------------------------------------------------------------------------------- choice
    def _targets_by_transport(self, lora: bool = True) -> tuple[dict[str, list], bool]:
        """Rank 0: each transport in use and its engines, and whether the syncs send the adapters alone (`lora`:
        the actor has adapters; rollout.lora_sync=auto sends them alone when every engine's transport takes them)."""
        targets = self.engine.weight_targets()
        wanted = lora and self.rollout.lora_sync in (ADAPTER_SYNC, "auto")
        groups = self._groups(targets, wanted)
        if wanted and not self.rollout.sends_adapters and not all(TRANSPORT_KINDS[n].adapters for n in groups):
            wanted, groups = False, self._groups(targets, False)  # auto: an engine takes full weights only
        alone = [name for name in groups if TRANSPORT_KINDS[name].alone]
        if alone and len(groups) > 1:
            raise ValueError(f"engines taking {alone[0]} must all take it; this pool mixes {sorted(groups)}")
        plain = [name for name in groups if not TRANSPORT_KINDS[name].adapters]
        if self.rollout.sends_adapters and plain:
            which = next(t for t in targets if t in groups[plain[0]])
            raise ValueError(
                f"rollout.lora_sync=adapter: {getattr(which, 'url', which)} takes full weights only (the "
                f"{plain[0]} transport; SGLang 0.5.23's LoRA routes need a GPU on this build, docs/engines.md); set "
                "rollout.lora_sync=merged (or auto: adapters where the engines take them, merged elsewhere)"
            )
        return groups, wanted and not plain

    def _groups(self, targets: list, adapters: bool) -> dict[str, list]:
        groups: dict[str, list] = {}
        for target in targets:
            name = choose_transport(target.weight_transports, self.rollout.colocated, adapters=adapters)
            groups.setdefault(name, []).append(target)
        return groups

    def _layout(self) -> IpcLayout:
        local = self.local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or max(torch.cuda.device_count(), 1)
        return IpcLayout(
            local_world_size=local, world_size=dist.get_world_size(self.group), engines_per_node=self.engines_per_node
        )

    def _choose_transports(self, lora: bool) -> None:
        """Collective: rank 0 decides, every rank builds its transports from the decision."""
        by_transport, adapters = self._targets_by_transport(lora) if self.rank == 0 else ({}, False)
        box = [None]
        if self.rank == 0:
            kinds = {name: TRANSPORT_KINDS[name] for name in by_transport}
            decisions = {n: k.decide(by_transport[n], self._layout()) for n, k in kinds.items() if k.decide}
            box = [TransportChoice(sorted(by_transport, key=TRANSPORTS.index), adapters, decisions)]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        self.choice = box[0]
        for name in self.choice.transports:
            kind = TRANSPORT_KINDS[name]
            if kind.all_ranks or self.rank == 0:
                setup = TransportSetup(
                    by_transport.get(name), self.rollout, self.rank, self.group, self.choice.decisions.get(name)
                )
                self.transports.append(kind.build(setup))

    # ----------------------------------------------------------------------------------------- push
    def push(self, model: torch.nn.Module, hf_cfg, pgs, weight_version: str | None) -> SyncStats | None:
        """Collective: every rank of `group` and of pgs.tp / pgs.pp (and pgs.ep of a MoE actor at EP > 1)
        calls it. Returns stats on rank 0. WaitAbandoned on every rank when rank 0's waits on the engines were
        given up (a preemption signal; the module docstring)."""
        t0 = time.perf_counter()
        self._sent = (0, 0)
        if self.choice is None:
            lora = lora_meta(model) is not None
            if self.rollout.sends_adapters and not lora:
                raise ValueError("rollout.lora_sync=adapter but the actor has no adapters: set student.lora.enabled")
            self._choose_transports(lora)
        colocated, abandoned = self.rollout.colocated, False
        if colocated:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # every rank: hand the cached blocks back before engines re-allocate
            abandoned = _abandoned(self._resume, ("weights",))
        state = model_state(model)
        adapter = None
        if self.choice.adapters:
            meta = lora_meta(model)
            if not self.base_sent or colocated:  # the engines merge into the base they keep: it must be the actor's
                abandoned = self._full(_base_state(state), hf_cfg, pgs, weight_version) or abandoned
                self.base_sent = True  # on every rank alike: whether the base goes decides a collective gather
            adapter = _Counter(gather_adapter_weights(state, hf_cfg, pgs.tp, pgs.pp))
            abandoned = (
                _abandoned(self._send_adapter, adapter, AdapterMeta(meta["rank"], meta["alpha"]), weight_version)
                or abandoned
            )
            for _ in adapter:  # ranks that send nothing still take part in every gather and PP broadcast
                pass
        else:
            abandoned = self._full(state, hf_cfg, pgs, weight_version) or abandoned
        if colocated and not abandoned:
            abandoned = _abandoned(self._resume, ("kv_cache", "cuda_graph"))
        flag = torch.tensor([float(abandoned)], device=device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)  # the barrier, and rank 0's news
        if flag.item() > 0:
            raise WaitAbandoned(
                f"weight sync of version {weight_version}: abandoned, a stop was requested (preemption signal)"
            )
        if self.rank != 0:
            return None
        tensors, sent = self._sent
        if adapter is not None:
            tensors, sent = tensors + adapter.tensors, sent + adapter.bytes
        adapter_bytes = adapter.bytes if adapter is not None else 0
        return SyncStats(time.perf_counter() - t0, tensors, sent, list(self.choice.transports), adapter_bytes)

    def _full(self, state, hf_cfg, pgs, weight_version: str | None) -> bool:
        """Gathers and sends every weight of `state` (an adapted one merged); True when a wait was abandoned."""
        counted = _Counter(gather_hf_weights(state, hf_cfg, pgs.tp, pgs.pp, ep_group=expert_group(pgs)))
        # Rank 0 sends even after an abandoned resume: a transport of every rank (cuda_ipc) has collectives, and
        # its requests then end at once, together (an abandoned one is shared there).
        abandoned = _abandoned(self._send, counted, weight_version)
        for _ in counted:  # ranks that send nothing still take part in every gather and PP broadcast
            pass
        self._sent = (self._sent[0] + counted.tensors, self._sent[1] + counted.bytes)
        return abandoned

    def _send_adapter(self, counted: "_Counter", meta: AdapterMeta, weight_version: str | None) -> None:
        senders = [t for t in self.transports if t.all_ranks or self.rank == 0]
        named = list(counted) if len(senders) > 1 else counted  # each transport needs the whole stream
        for t in senders:
            t.push_adapter(named, meta, weight_version)

    def _send(self, counted: "_Counter", weight_version: str | None) -> None:
        senders = [t for t in self.transports if t.all_ranks or self.rank == 0]
        if len(senders) > 1:
            named = list(counted)  # each transport needs the whole stream
            for t in senders:
                t.push(named, weight_version)
        elif senders:
            senders[0].push(counted, weight_version)

    def _resume(self, tags: tuple[str, ...]) -> None:
        """Rank 0: resumes those of `tags` each engine released (none at start-up, before any release)."""
        if self.rank != 0:
            return
        for target in self.engine.weight_targets():
            released = [t for t in tags if t in target.released_tags]
            if released:
                target.resume_memory(released)

    def close(self) -> None:
        for t in self.transports:
            t.close()
        self.transports, self.choice, self.base_sent = [], None, False


def _abandoned(fn, *args) -> bool:
    """fn(*args); True when it gave up a wait on the engines (WaitAbandoned), False when it finished."""
    try:
        fn(*args)
        return False
    except WaitAbandoned:
        return True


def _base_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA actor's state without its adapters: gather_hf_weights then yields the frozen base unmerged."""
    return {k: v for k, v in state.items() if not k.endswith((ADAPTER_A, ADAPTER_B))}


def expert_group(pgs):
    """The expert-parallel group of a layout's ProcessGroupCollection, None when there is none or it
    has one rank (a dense model, or EP 1: each rank then holds every expert)."""
    group = getattr(pgs, "ep", None)
    return group if group is not None and group.size() > 1 else None


class _Counter:
    """Passes (name, tensor) through once, counting tensors and bytes; iterating again yields nothing."""

    def __init__(self, it: Iterator):
        self.it, self.tensors, self.bytes = iter(it), 0, 0

    def __iter__(self):
        for name, t in self.it:
            self.tensors += 1
            self.bytes += t.numel() * t.element_size()
            yield name, t
