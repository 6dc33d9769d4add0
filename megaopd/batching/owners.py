"""Which actor data-parallel replica trains each row of a step's batch: where every row's scores must land.

    owners = RowOwners(tuple(row_owners(...)), dp_rank, dp_size, sends=..., ranks=...)
    owners.rows()        # this replica's rows, increasing: the rows its TokenScores hold
"""
from __future__ import annotations

from dataclasses import dataclass

from megaopd.parallel.dist import world_size


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
    ranks: tuple[tuple[int, bool], ...] | None = None
    """Per global rank, its (dp_rank, sends): the same layout every step, so the trainer gathers it once
    (scoring.exchange.owner_ranks); None: every routing pass gathers it again (a small all_gather)."""

    @staticmethod
    def replicated(num_rows: int, rank: int) -> "RowOwners":
        """Every rank holds every row (one replica, global rank 0 speaking for it): `megaopd logprobs`, tests."""
        world = world_size()
        return RowOwners(tuple([0] * num_rows), 0, 1, rank == 0, tuple((0, r == 0) for r in range(world)))

    def rows(self, dp_rank: int | None = None) -> list[int]:
        """Rows owned by `dp_rank` (default: this rank's replica), increasing."""
        d = self.dp_rank if dp_rank is None else dp_rank
        return [b for b, o in enumerate(self.owner_B) if o == d]

    def subset(self, batch_rows: list[int]) -> "RowOwners":
        """The owners of a sub-batch made of `batch_rows` (its row i is batch row batch_rows[i])."""
        return RowOwners(tuple(self.owner_B[b] for b in batch_rows), self.dp_rank, self.dp_size, self.sends,
                         self.ranks)
