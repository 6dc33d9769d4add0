"""The weight-update process group shared by a trainer and rollout engines.

Both sides build the group the way SGLang does (init_custom_process_group): a TCP rendezvous at
tcp://master_address:master_port (the trainer, rank 0, hosts the store), the store wrapped in a
PrefixStore named after the group, and a process group of `backend` created on it. This works beside
(or without) a default torch.distributed group, so a trainer already inside torchrun can open one
group per set of engines, and a `megaopd serve` process needs no default group at all. What travels
over it is described in megaopd.rollout.weight_wire.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Joins (rank > 0) or hosts (rank 0) a standalone process group; blocks until all ranks arrive."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    # The store directly, not torch's tcp:// rendezvous: under torchrun (TORCHELASTIC_USE_AGENT_STORE=True in
    # every rank's environment) that rendezvous makes rank 0 a client of a store that torchrun's agent hosts,
    # which for this port nobody does, and the trainer and its engines waited on each other until the timeout
    # (found by rehearsing a 2-node job with engines: docs/cluster.md).
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout)
    # The prefix keeps two groups on one store (or a reused port) from reading each other's keys.
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    # Registering the ranks lets torch.distributed's collectives and destroy_process_group accept the group.
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_custom_process_group(pg: dist.ProcessGroup) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 - a group whose peer died may fail to tear down; drop it anyway
        pass


def broadcast(tensor: torch.Tensor, pg: dist.ProcessGroup, async_op: bool = False):
    """Broadcast from the group's rank 0 (the trainer); group_src avoids any global-rank lookup."""
    return dist.broadcast(tensor, group=pg, group_src=0, async_op=async_op)
