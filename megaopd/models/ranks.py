"""Run a function on the ranks of a model layout: the job's ranks under torchrun/srun, else local workers.

    results = run_on_ranks(fn, world_size=tp * pp, args=(...))   # fn(rank, world_size, *args)

Under torchrun (RANK and WORLD_SIZE set) this process is one rank: it initializes torch.distributed,
runs fn once and returns [its result]; the job's world size must be a multiple of tp * pp (the rest is
data parallel). Otherwise it starts `world_size` gloo workers with megaopd.parallel.launch.spawn
(a single rank runs in this process: no start-up cost of a second interpreter).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from megaopd.models.hf_config import InputError


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_world(model_parallel_size: int) -> None:
    """InputError when the launcher's world size cannot hold tp * pp ranks."""
    if under_launcher():
        world = int(os.environ["WORLD_SIZE"])
        if world % model_parallel_size:
            raise InputError(f"the job has {world} ranks, not a multiple of tp*pp = {model_parallel_size}; "
                             "launch tp*pp (or a multiple) ranks")


def run_on_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                 timeout: float = 3600) -> list[Any]:
    from megaopd.parallel.dist import destroy_distributed, init_distributed

    if under_launcher():
        check_world(world_size)
        init_distributed()
        import torch.distributed as dist

        try:
            return [fn(dist.get_rank(), dist.get_world_size(), *args)]
        finally:
            destroy_distributed()
    if world_size == 1:
        init_distributed()
        try:
            return [fn(0, 1, *args)]
        finally:
            destroy_distributed()
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # set by init_distributed for one process
                os.environ.pop(key, None)
    from megaopd.parallel.launch import spawn

    return spawn(fn, world_size, args, timeout=timeout)
