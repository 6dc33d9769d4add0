"""Process groups for the two model layouts of one job.

The actor and the reference share megatron's global parallel_state (initialize_actor_layout): the
pipeline schedule, DDP and the optimizer read it. The teacher gets its own ProcessGroupCollection over
the same ranks (build_process_groups), passed explicitly to its GPTModel, so it can use another TP/PP
without touching the global state. Rank order is megatron's default "tp-cp-ep-dp-pp": TP ranks are
adjacent, PP stages are the slowest-varying dimension.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass(frozen=True)
class Layout:
    """A model's parallel layout over the job's ranks."""

    tp: int = 1
    pp: int = 1

    def dp(self, world_size: int) -> int:
        if world_size % (self.tp * self.pp):
            raise ValueError(f"world size {world_size} is not a multiple of tp*pp = {self.tp}*{self.pp}; "
                             f"choose tp and pp whose product divides the number of ranks")
        return world_size // (self.tp * self.pp)


def initialize_actor_layout(layout: Layout, seed: int = 1234) -> ProcessGroupCollection:
    """Sets megatron's global parallel_state to the actor layout and seeds its RNG tracker."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    layout.dp(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        create_gloo_process_groups=dist.get_backend() != "gloo",
    )
    model_parallel_cuda_manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["tp", "pp", "mp", "cp", "tp_cp", "embd", "pos_embd", "dp", "dp_cp", "tp_dp_cp"])


def build_process_groups(layout: Layout) -> ProcessGroupCollection:
    """A ProcessGroupCollection for `layout` over all ranks, independent of parallel_state.

    Every rank must call this (group creation is collective). Groups: tp, pp, cp (size 1), tp_cp,
    dp, dp_cp, mp (tp x pp), embd (first and last PP stage), pos_embd (first stage).
    """
    world = dist.get_world_size()
    dp = layout.dp(world)
    grid = HyperCommGrid([layout.tp, 1, dp, layout.pp], ["tp", "cp", "dp", "pp"])
    pgs = {
        "tp": grid.create_pg("tp"),
        "cp": grid.create_pg("cp"),
        "tp_cp": grid.create_pg(["tp", "cp"]),
        "dp": grid.create_pg("dp"),
        "dp_cp": grid.create_pg(["cp", "dp"]),
        "pp": grid.create_pg("pp"),
        "mp": grid.create_pg(["tp", "pp"]),
        "tp_dp_cp": grid.create_pg(["tp", "cp", "dp"]),
    }
    # Embedding groups join the first and last pipeline stage of each pipeline (tied embeddings and
    # their gradient all-reduce); position embeddings live on the first stage only.
    embd = pos_embd = None
    for pp_ranks in grid.get_rank_enum("pp"):
        ends = sorted({pp_ranks[0], pp_ranks[-1]})
        g = dist.new_group(ends)
        g_pos = dist.new_group([pp_ranks[0]])
        if dist.get_rank() in ends:
            embd = g
        if dist.get_rank() == pp_ranks[0]:
            pos_embd = g_pos
    pgs["embd"] = embd
    pgs["pos_embd"] = pos_embd
    return ProcessGroupCollection(**pgs)
