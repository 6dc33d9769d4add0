"""The weight-update process group shared by a trainer and rollout engines, and the bucket wire format.

Both sides build the group the way SGLang does (init_custom_process_group): a TCP rendezvous at
tcp://master_address:master_port (the trainer, rank 0, hosts the store), the store wrapped in a
PrefixStore named after the group, and a process group of `backend` created on it. This works beside
(or without) a default torch.distributed group, so a trainer already inside torchrun can open one
group per set of engines, and a `megaopd serve` process needs no default group at all.

Wire format of one update (SGLang's /update_weights_from_distributed):
  load_format None:                one broadcast from rank 0 per tensor, in `names` order;
  load_format "flattened_bucket":  one broadcast of a uint8 tensor: the tensors' bytes concatenated in
                                   `names` order (each flattened, native dtype), as SGLang's
                                   FlattenedTensorBucket lays them out.
"""
from __future__ import annotations

import datetime
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16; ValueError naming the accepted strings."""
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def init_custom_process_group(backend: str, master_address: str, master_port: int, rank: int,
                              world_size: int, group_name: str, timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Joins (rank > 0) or hosts (rank 0) a standalone process group; blocks until all ranks arrive."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{int(master_port)}"
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    # The prefix keeps two groups on one store (or a reused port) from reading each other's keys.
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout)
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


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, concatenated in order, as one uint8 tensor on the first tensor's device."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def bucket_nbytes(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> int:
    total = 0
    for dtype, shape in zip(dtypes, shapes):
        numel = 1
        for s in shape:
            numel *= int(s)
        total += numel * torch.empty((), dtype=dtype).element_size()
    return total


def unflatten_bucket(flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[torch.dtype],
                     shapes: Sequence[Sequence[int]]) -> list[tuple[str, torch.Tensor]]:
    """Views into `flat` (uint8) for each (name, dtype, shape), in order; inverse of flatten_bucket."""
    out, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        n = bucket_nbytes([dtype], [shape])
        out.append((name, flat[offset:offset + n].view(dtype).reshape(tuple(int(s) for s in shape))))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes but the metadata describes {offset}")
    return out


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Groups tensors, in order, into lists of at most `bucket_bytes` (a larger tensor gets its own bucket)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
