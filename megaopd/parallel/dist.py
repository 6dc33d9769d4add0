"""torch.distributed start-up: NCCL on GPUs, gloo (plus megatron CPU compatibility) without one.

Works under torchrun/srun (reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and inside
workers started by `megaopd.parallel.launch.spawn`, which set the same variables.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


def has_gpu() -> bool:
    return torch.cuda.is_available()


def default_backend() -> str:
    return "nccl" if has_gpu() else "gloo"


def device() -> torch.device:
    """The device this rank computes on: its local GPU, or the CPU."""
    if has_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_rank() -> int:
    """This process's GPU on its node: torchrun's LOCAL_RANK, else Slurm's SLURM_LOCALID; one process alone
    takes GPU 0. Several ranks with neither would all pick GPU 0 (NCCL: "Duplicate GPU detected")."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            "WORLD_SIZE > 1 but neither LOCAL_RANK nor SLURM_LOCALID says which GPU this rank "
            "uses: start the ranks with torchrun (or srun), which set them"
        )
    return 0


def global_rank() -> int:
    """This process's rank in the default group; 0 when no group is initialized (one process)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Ranks in the default group; 1 when no group is initialized (one process)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def find_free_port() -> int:
    """A TCP port free on this host now (the OS picks it; another process may take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str | None = None, timeout_minutes: int = 30) -> None:
    """Initializes the default process group once (idempotent) and the CPU compatibility if needed.

    With no WORLD_SIZE in the environment it starts a one-process group on a free local port, so
    library code can always assume torch.distributed is initialized.
    """
    if not has_gpu():
        from megaopd.parallel import cpu_compat

        cpu_compat.enable()
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    if "WORLD_SIZE" not in os.environ:
        # A one-process group of its own. A tcp:// rendezvous instead of MASTER_* variables leaves nothing
        # in the environment for child processes (a later torchrun or sbatch) to inherit.
        dist.init_process_group(
            backend=backend, init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1, timeout=timeout
        )
        return
    dist.init_process_group(
        backend=backend,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


def destroy_distributed() -> None:
    import sys

    parallel_state = sys.modules.get("megatron.core.parallel_state")  # never import megatron just to tear down
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def rank0_computes(fn, *args, **kwargs):
    """fn(*args, **kwargs) run on global rank 0 only, its (picklable) result received by every rank.

    For what one process owns: the rollout engine, the tokenizer's text work, math-verify. Collective:
    every rank must call it at the same point. Object broadcasts pickle: only for our own results,
    never for data read from outside."""
    box = [fn(*args, **kwargs) if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0, device=device() if has_gpu() else None)
    return box[0]


def holds_results(pgs) -> bool:
    """Whether this rank speaks for its model replica's per-row results: TP rank 0 of the last pipeline stage.
    Only the last stage computes the output layer, and its TP ranks hold the same reduced values, so exactly
    one rank per data-parallel replica reports or sends them. `pgs`: the model's ProcessGroupCollection."""
    return pgs.tp.rank() == 0 and pgs.pp.rank() == pgs.pp.size() - 1
