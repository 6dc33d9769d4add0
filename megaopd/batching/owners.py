"""Where a step's rows and their scores live: each rank's place in a model's layout (WorldLayout) and the
actor data-parallel replica that trains each row (RowOwners).

    owners = RowOwners(tuple(row_owners(...)), dp_rank, dp_size, sends=..., layout=owner_layout)
    owners.rows()        # this replica's rows, increasing: the rows its TokenScores hold
    layout = WorldLayout.gather(pgs.dp.rank(), speaks, device)   # once per model and run (collective)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaopd.parallel.dist import world_size


@dataclass(frozen=True)
class RankPlace:
    """One global rank's place in a model's layout."""

    dp_rank: int
    """Its data-parallel replica."""
    speaks: bool
    """It sends for its replica when rows' data move between layouts (one rank per replica)."""


@dataclass(frozen=True)
class WorldLayout:
    """Every global rank's place in one model's layout, by global rank. Fixed for a run: gathered once per
    model (at start-up) and passed to every routing pass."""

    places: tuple[RankPlace, ...]

    @staticmethod
    def gather(dp_rank: int, speaks: bool, device: torch.device) -> "WorldLayout":
        """This rank's place, and every other rank's: one small all_gather, collective over the world (the
        default group, whose ranks the routing addresses); `device` is its backend's device."""
        if world_size() == 1:
            return WorldLayout((RankPlace(dp_rank, speaks),))
        mine = torch.tensor([dp_rank, int(speaks)], dtype=torch.long, device=device)
        parts = [torch.empty_like(mine) for _ in range(world_size())]
        dist.all_gather(parts, mine)
        return WorldLayout(tuple(RankPlace(int(p[0]), bool(p[1])) for p in parts))

    def replica(self, dp_rank: int) -> frozenset[int]:
        """The global ranks of one data-parallel replica."""
        return frozenset(r for r, p in enumerate(self.places) if p.dp_rank == dp_rank)


@dataclass(frozen=True)
class RowOwners:
    """Which actor data-parallel replica trains each row of a step's batch (made by
    batching.shares.row_owners, the same partition its micro-batches take). Every TP/PP rank of a
    replica holds that replica's rows' scores: the loss runs on the last PP stage, and each TP rank needs them."""

    owner_B: tuple[int, ...]
    """Actor DP rank that trains each batch row."""
    dp_rank: int
    """This rank's actor DP rank."""
    dp_size: int
    """Actor DP size."""
    sends: bool
    """This rank speaks for its replica when owned rows' data must move (actor TP rank 0 and PP rank 0)."""
    layout: WorldLayout | None = None
    """Every global rank's actor replica and whether it speaks for it: the same every step, so the trainer
    gathers it once; None: each routing pass gathers it again (world_layout, a small all_gather)."""

    @staticmethod
    def replicated(num_rows: int, rank: int) -> "RowOwners":
        """Every rank holds every row (one replica, global rank 0 speaking for it): `megaopd logprobs`, tests."""
        layout = WorldLayout(tuple(RankPlace(0, r == 0) for r in range(world_size())))
        return RowOwners(tuple([0] * num_rows), 0, 1, rank == 0, layout)

    def world_layout(self, device: torch.device) -> WorldLayout:
        """`layout`, or gathered now when the caller did not set it (collective over the world)."""
        return self.layout if self.layout is not None else WorldLayout.gather(self.dp_rank, self.sends, device)

    def rows(self, dp_rank: int | None = None) -> list[int]:
        """Rows owned by `dp_rank` (default: this rank's replica), increasing."""
        d = self.dp_rank if dp_rank is None else dp_rank
        return [b for b, o in enumerate(self.owner_B) if o == d]

    def subset(self, batch_rows: list[int]) -> "RowOwners":
        """The owners of a sub-batch made of `batch_rows` (its row i is batch row batch_rows[i])."""
        return RowOwners(
            tuple(self.owner_B[b] for b in batch_rows), self.dp_rank, self.dp_size, self.sends, self.layout
        )
