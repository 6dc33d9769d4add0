"""Where a scoring pass scores each row, and how the scores reach the ranks that own the row.

    routes = RowRoutes(owners=owners, scorers=scorers, owner_layout=owner_layout)
    assignment = assign_scoring(tokens_BS, batches, runner, routes)                  # which rows, where
    at_ids = route_at_ids(at_ids_BTK, assignment, routes, device)                    # to the scorers
    ... forward passes (scoring/passes.py) ...
    scores = keep_owned(local, assignment, outputs, owners, pp_group, device, ran)   # aligned layouts
    scores = send_to_owners(local, assignment, outputs, routes, speaks, device)      # others

When the scoring model's data-parallel replicas are the owners' (the actor, the reference, a teacher in the
actor's layout: `aligned`) each replica scores exactly its owned rows and nothing moves but the last pipeline
stage's broadcast. Otherwise (a teacher in another layout) each replica scores its share (padded: contiguous
rows; packed: balanced by tokens and attention cost) and one all_to_all (parallel/exchange.py) sends each
row's real positions from the share's speaker (TP rank 0 of the last PP stage) to every rank of the owning
replica; ids to score at travel the other way first. Collective over the world.

Shape legend: B rows, S padded sequence length, T = S - 1 positions, K top-k size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megaopd.batching.micro_batches import ScoringBatches
from megaopd.batching.owners import RowOwners, WorldLayout
from megaopd.batching.packing import row_lengths
from megaopd.batching.shares import balanced_partition, dp_rows
from megaopd.parallel.dist import holds_results
from megaopd.parallel.exchange import pack_columns, route_rows, scatter_received, unpack_columns
from megaopd.rollout.records import ScoreField, TokenScores
from megaopd.scoring.runner import PipelineRunner, broadcast_from_last_stage


@dataclass(frozen=True, kw_only=True)
class RowRoutes:
    """Who keeps each row of a pass, and where every global rank sits in the two layouts its scores cross."""

    owners: RowOwners
    """Which actor data-parallel replica keeps each row."""
    scorers: WorldLayout
    """Every rank's replica in the scoring model's layout, and whether it speaks for its share (scorer_layout)."""
    owner_layout: WorldLayout
    """Every rank's replica in the owners' layout (owners.world_layout)."""


@dataclass(frozen=True)
class ScoringAssignment:
    """Which rows each replica of the scoring model scores in one pass, and what travels to the owners."""

    shares: list[list[int]]
    """Per data-parallel replica of the scoring model, the batch rows it scores (increasing)."""
    dp_rank: int
    """This rank's replica in the scoring model's layout."""
    aligned: bool
    """The scoring model's replicas are the owners': each scores its owned rows, nothing moves."""
    packed: bool
    """Packed micro-batches (the batches ask for them and the model takes packed rows)."""
    lengths: list[int]
    """Real tokens per batch row."""
    positions: list[int]
    """Real positions per batch row (length - 1, at most T): the values that travel; later ones are 0."""
    T: int
    """Positions of a padded row (S - 1)."""

    @property
    def rows(self) -> list[int]:
        """The batch rows this rank's replica scores."""
        return self.shares[self.dp_rank]


@dataclass(frozen=True)
class PassOutputs:
    """The score fields a pass yields (rollout.records.SCORE_FIELDS order) and the sizes of their last dim."""

    fields: tuple[ScoreField, ...]
    topk: int = 0
    """The pass's top-k."""
    at_ids: int = 0
    """How many ids it scores at per position."""

    def trailing(self, field: ScoreField) -> tuple[int, ...]:
        return field.trailing(self.topk, self.at_ids)

    def width(self, field: ScoreField) -> int:
        """Values per position (a payload column group of route_rows)."""
        return max(1, math.prod(self.trailing(field)))


def scorer_layout(pgs: ProcessGroupCollection, device: torch.device) -> WorldLayout:
    """Every global rank's DP replica in a scoring model's layout and whether it speaks for its share (TP rank 0
    of the last PP stage, which holds the results). Fixed for a run: gathered once per model (collective)."""
    return WorldLayout.gather(pgs.dp.rank(), holds_results(pgs), device)


def assign_scoring(
    tokens_BS: torch.Tensor,
    batches: ScoringBatches,
    runner: PipelineRunner,
    routes: RowRoutes,
) -> ScoringAssignment:
    """Which replica scores which rows of the pass: aligned layouts score the owned rows; otherwise packed
    shares are balanced by tokens and attention cost, padded ones contiguous."""
    pgs = runner.pgs
    S = tokens_BS.shape[1]
    packed = batches.max_tokens is not None and runner.packs
    lengths = row_lengths(tokens_BS, batches.lengths_B)
    owners = routes.owners
    aligned = is_aligned(pgs.dp.size(), owners, routes.scorers, routes.owner_layout)
    shares = scoring_shares(lengths, pgs.dp.size(), packed, owners if aligned else None)
    return ScoringAssignment(shares, pgs.dp.rank(), aligned, packed, lengths, [min(n, S) - 1 for n in lengths], S - 1)


def is_aligned(dp_size: int, owners: RowOwners, scorers: WorldLayout, owner_layout: WorldLayout) -> bool:
    """The scoring model's data-parallel replicas are the owners' (same ranks, same replica numbers)."""
    return dp_size == owners.dp_size and all(
        s.dp_rank == o.dp_rank for s, o in zip(scorers.places, owner_layout.places)
    )


def scoring_shares(lengths: list[int], dp_size: int, packed: bool, aligned_owners: RowOwners | None) -> list[list[int]]:
    """Per replica of the scoring model, the rows it scores: the owned rows when the layouts align
    (aligned_owners given), else balanced by tokens and attention cost (packed) or contiguous. Pure: every
    rank computes every replica's share (batching.delivery sends each its rows' tokens from these)."""
    if aligned_owners is not None:
        return [aligned_owners.rows(d) for d in range(aligned_owners.dp_size)]
    if packed:
        return balanced_partition([[n] for n in lengths], dp_size)
    return [list(dp_rows(len(lengths), d, dp_size)) for d in range(dp_size)]


def route_at_ids(
    at_ids_BTK: torch.Tensor,
    assignment: ScoringAssignment,
    routes: RowRoutes,
    device: torch.device,
) -> torch.Tensor:
    """The owners' ids to score at (this rank's owned rows, owners.rows() order) -> every rank of the replica
    that scores each row: [len(assignment.rows), T, K] int32 in share order."""
    K, T = at_ids_BTK.shape[-1], assignment.T
    owners = routes.owners
    mine = owners.rows()
    scorer = {b: d for d, share in enumerate(assignment.shares) for b in share}
    groups = [routes.scorers.replica(d) for d in range(len(assignment.shares))]
    dests = [groups[scorer[b]] for b in range(len(assignment.positions))]
    held = [owners.rows(p.dp_rank) if p.speaks else [] for p in routes.owner_layout.places]
    payload = None
    if owners.sends and mine:
        valid = valid_positions([assignment.positions[b] for b in mine], T)
        payload = pack_columns([at_ids_BTK[:, :T].int().to(device)[valid.to(device)]])
    received, values = route_rows(payload, held, dests, assignment.positions, K, device)
    return scatter_received(
        unpack_columns(values, [K], [torch.int32])[0], received, assignment.positions, assignment.rows, T
    )


def keep_owned(
    local: TokenScores | None,
    assignment: ScoringAssignment,
    outputs: PassOutputs,
    owners: RowOwners,
    pp_group,
    device: torch.device,
    ran: bool,
) -> TokenScores:
    """Aligned layouts: the scores stay on the replica that computed them. Every TP rank has them; under PP
    the last stage's, broadcast over the PP group (ran: this rank had micro-batches, as every rank of its
    PP group). Positions past each row's real ones are 0. CPU tensors."""
    rows = assignment.rows
    valid_BT = valid_positions([assignment.positions[b] for b in rows], assignment.T)
    out = {}
    for f in outputs.fields:
        trailing = outputs.trailing(f)
        x = None if local is None else getattr(local, f.name)
        if pp_group.size() > 1 and ran:
            x = broadcast_from_last_stage(x, (len(rows), assignment.T, *trailing), f.dtype, pp_group, device)
        x = x.cpu() if x is not None else torch.zeros((0, assignment.T, *trailing), dtype=f.dtype)
        out[f.name] = x * valid_BT.reshape(*valid_BT.shape, *[1] * len(trailing)).to(f.dtype)
    return TokenScores(**out, rows=owners.rows())


def send_to_owners(
    local: TokenScores | None,
    assignment: ScoringAssignment,
    outputs: PassOutputs,
    routes: RowRoutes,
    speaks: bool,
    device: torch.device,
) -> TokenScores:
    """Another layout: one all_to_all from each share's speaker to the owning replicas' ranks, the real
    positions only (float32 and int32 columns bit for bit). The owned rows' scores, CPU tensors."""
    held = [assignment.shares[p.dp_rank] if p.speaks else [] for p in routes.scorers.places]
    dests = [routes.owner_layout.replica(o) for o in routes.owners.owner_B]
    widths = [outputs.width(f) for f in outputs.fields]
    payload = None
    if speaks and assignment.rows:
        valid = valid_positions([assignment.positions[b] for b in assignment.rows], assignment.T).to(device)
        payload = pack_columns(
            [getattr(local, f.name).to(device)[valid].reshape(-1, w) for f, w in zip(outputs.fields, widths)]
        )
    received, values = route_rows(payload, held, dests, assignment.positions, sum(widths), device)
    mine = routes.owners.rows()
    columns = unpack_columns(values, widths, [f.dtype for f in outputs.fields])
    out = {
        f.name: scatter_received(
            col.reshape(-1, *outputs.trailing(f)), received, assignment.positions, mine, assignment.T
        )
        for f, col in zip(outputs.fields, columns)
    }
    return TokenScores(**out, rows=mine)


def valid_positions(counts: list[int], T: int) -> torch.Tensor:
    """[len(counts), T] bool: True at the first counts[i] positions of row i."""
    return torch.arange(T).unsqueeze(0) < torch.tensor(counts, dtype=torch.long).reshape(-1, 1)
