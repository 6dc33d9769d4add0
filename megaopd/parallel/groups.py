"""Process groups for the two model layouts of one job.

The actor and the reference share megatron's global parallel_state (initialize_actor_layout): the
pipeline schedule, DDP and the optimizer read it. The teacher gets its own ProcessGroupCollection over
the same ranks (build_process_groups), passed explicitly to its GPTModel, so it can use another TP/PP
without touching the global state. Rank order is megatron's default "tp-cp-ep-dp-pp": TP ranks are
adjacent, PP stages are the slowest-varying dimension.

Expert parallelism (EP) splits a MoE model's routed experts over `ep` ranks that are, for everything
else (attention, norms, router, embeddings), data-parallel replicas: as in megatron, the expert layout
is [expert TP = tp, ep, dp / ep, pp] over the same ranks, so each EP group is `ep` consecutive DP ranks
of one TP rank and one stage. Those ranks exchange tokens in every MoE layer: they must run the same
number of micro-batches of the same shape in lockstep.
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
    ep: int = 1
    """Expert-parallel size (MoE models only): must divide the data-parallel size and the experts."""

    def dp(self, world_size: int) -> int:
        if world_size % (self.tp * self.pp):
            raise ValueError(
                f"world size {world_size} is not a multiple of tp*pp = {self.tp}*{self.pp}; "
                f"choose tp and pp whose product divides the number of ranks"
            )
        dp = world_size // (self.tp * self.pp)
        if self.ep < 1 or dp % self.ep:
            raise ValueError(
                f"ep={self.ep} does not divide the data-parallel size {dp} (world {world_size} / "
                f"tp*pp = {self.tp}*{self.pp}); expert-parallel ranks are data-parallel ranks: "
                f"choose ep among the divisors of {dp}"
            )
        return dp


def initialize_actor_layout(layout: Layout, seed: int = 1234) -> ProcessGroupCollection:
    """Sets megatron's global parallel_state to the actor layout and seeds its RNG tracker."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    layout.dp(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        create_gloo_process_groups=dist.get_backend() != "gloo",
    )
    model_parallel_cuda_manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=ACTOR_PGS)


# The groups of megaopd's models: GPTModel and the pipeline schedule (tp ... tp_dp_cp) and the MoE
# layers (ep, expt_tp, expt_dp, tp_ep, tp_ep_pp; size-1 / dense-equal groups for a dense model).
ACTOR_PGS = [
    "tp",
    "pp",
    "mp",
    "cp",
    "tp_cp",
    "embd",
    "pos_embd",
    "dp",
    "dp_cp",
    "tp_dp_cp",
    "ep",
    "expt_tp",
    "expt_dp",
    "tp_ep",
    "tp_ep_pp",
]


def build_process_groups(layout: Layout) -> ProcessGroupCollection:
    """A ProcessGroupCollection for `layout` over all ranks, independent of parallel_state.

    Every rank must call this (group creation is collective). Groups: tp, pp, cp (size 1), tp_cp,
    dp, dp_cp, mp (tp x pp), embd (first and last PP stage), pos_embd (first stage), and the expert
    groups of megatron's MoE layers: ep, expt_tp (= tp), expt_dp (dp / ep), tp_ep, tp_ep_pp.
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
    # Expert layout over the same ranks: the DP dimension split into [ep, dp / ep] (ep fastest), as
    # megatron's expert rank generator "tp-ep-dp-pp" does with expert TP = TP.
    egrid = HyperCommGrid([layout.tp, layout.ep, dp // layout.ep, layout.pp], ["tp", "ep", "dp", "pp"])
    pgs.update(
        ep=egrid.create_pg("ep"),
        expt_tp=egrid.create_pg("tp"),
        expt_dp=egrid.create_pg("dp"),
        tp_ep=egrid.create_pg(["tp", "ep"]),
        tp_ep_pp=egrid.create_pg(["tp", "ep", "pp"]),
    )
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
