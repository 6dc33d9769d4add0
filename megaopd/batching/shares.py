"""Data-parallel shares: which rows each data-parallel replica takes (contiguous blocks, or packing units
balanced by tokens and attention cost), per mini-batch, and so which replica owns each row's scores.

    rows, golden_rows = mini_batch_rows(B, prompts, mini_batches, j, golden is not None)
    units, shares = dp_shares(rollout, golden, rows, golden_rows, dp_size, needs, packed)   # the partition
    owner_B = row_owners(rollout, golden, dp_size, needs, settings)    # the same partition, every mini-batch

Pure functions of the row counts and lengths: every rank computes the same shares, and a resumed run too.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch

from megaopd.batching.packing import GOLDEN, ON_POLICY, Segment
from megaopd.batching.settings import BatchingSettings
from megaopd.data import GoldenBatch
from megaopd.losses import LossNeeds
from megaopd.rollout.records import RolloutBatch


def dp_rows(num_rows: int, dp_rank: int, dp_size: int) -> range:
    """The contiguous block of rows data-parallel replica `dp_rank` of `dp_size` handles."""
    per = -(-num_rows // dp_size)
    return range(min(dp_rank * per, num_rows), min((dp_rank + 1) * per, num_rows))


def balanced_partition(unit_lengths: Sequence[Sequence[int]], parts: int) -> list[list[int]]:
    """Units (each a list of sequence lengths) into `parts` shares of nearly equal cost: the longest
    processing time rule on (tokens, attention cost sum(len^2)), deterministic (ties by index, then by
    share number), so that every rank and a resumed run compute the same shares. Returns each share's
    unit indices in increasing order (shares may be empty when units < parts)."""
    if parts < 1:
        raise ValueError(f"balanced_partition needs parts >= 1, got {parts}")
    cost = [(sum(ls), sum(n * n for n in ls)) for ls in unit_lengths]
    order = sorted(range(len(cost)), key=lambda i: (-cost[i][0], -cost[i][1], i))
    heap = [(0, 0, p) for p in range(parts)]  # (tokens, attention cost, share): least loaded first
    shares: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        tokens, attn, p = heapq.heappop(heap)
        shares[p].append(i)
        heapq.heappush(heap, (tokens + cost[i][0], attn + cost[i][1], p))
    return [sorted(s) for s in shares]


def mini_batch_rows(
    num_rows: int, num_prompts: int, mini_batches: int, j: int, golden: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """On-policy rows and golden rows (None without golden data) of mini-batch j of `mini_batches`."""
    rows = torch.arange(j * num_rows // mini_batches, (j + 1) * num_rows // mini_batches)
    golden_rows = (
        torch.arange(j * num_prompts // mini_batches, (j + 1) * num_prompts // mini_batches) if golden else None
    )
    return rows, golden_rows


def dp_shares(
    rollout: RolloutBatch | None,
    golden: GoldenBatch | None,
    rows: torch.Tensor,
    golden_rows: torch.Tensor | None,
    dp_size: int,
    needs: LossNeeds,
    packed: bool,
) -> tuple[list[list[Segment]], list[list[int]]]:
    """The packing units of one mini-batch and each DP rank's units (packed: balanced by tokens and
    attention cost), the one partition both the micro-batches and row_owners take."""
    if packed:
        units = packing_units(rollout, rows, golden, golden_rows, keep_groups=needs.rewards)
        return units, balanced_partition([[s.length for s in u] for u in units], dp_size)
    units = [[Segment(ON_POLICY, int(r), 1)] for r in rows.tolist()] if rollout is not None else []
    return units, [list(dp_rows(len(units), d, dp_size)) for d in range(dp_size)]


def row_owners(
    rollout: RolloutBatch, golden: GoldenBatch | None, dp_size: int, needs: LossNeeds, settings: BatchingSettings
) -> list[int]:
    """The actor DP rank that trains each on-policy row of the step: per mini-batch (mini_batch_rows),
    its rows shared over DP exactly as micro_batches.step_micro_batches shares them (packed:
    balanced_partition of the packing units, golden rows included; padded: contiguous dp_rows). Pure and
    deterministic, so every rank computes the same owners and a resumed run the same ones."""
    B, M = rollout.size, settings.mini_batches
    owner = [-1] * B
    for j in range(M):
        rows, golden_rows = mini_batch_rows(B, settings.prompts_per_step, M, j, golden is not None)
        units, shares = dp_shares(rollout, golden, rows, golden_rows, dp_size, needs, settings.packed)
        for d, share in enumerate(shares):
            for i in share:
                for seg in units[i]:
                    if seg.source == ON_POLICY:
                        owner[seg.row] = d
    if -1 in owner:
        raise ValueError(
            f"rows {[b for b, o in enumerate(owner) if o < 0][:8]} belong to no mini-batch: "
            f"{B} rows over trainer.mini_batches_per_step={M}"
        )
    return owner


def packing_units(
    rollout: RolloutBatch | None,
    rows: torch.Tensor,
    golden: GoldenBatch | None,
    golden_rows: torch.Tensor | None,
    keep_groups: bool,
) -> list[list[Segment]]:
    """The mini-batch's packing units: one sequence each, or a whole GRPO group (keep_groups)."""
    units: list[list[Segment]] = []
    if rollout is not None:
        lengths = (rollout.prompt_lens_B + rollout.response_lens_B).clamp(min=1).tolist()
        by_group: dict[int, list[Segment]] = {}
        for r in rows.tolist():
            seg = Segment(ON_POLICY, r, lengths[r])
            if keep_groups:
                by_group.setdefault(int(rollout.group_ids_B[r]), []).append(seg)
            else:
                units.append([seg])
        units += list(by_group.values())
    if golden is not None:
        lengths = golden.lengths_B.clamp(min=1).tolist()
        units += [[Segment(GOLDEN, g, lengths[g])] for g in golden_rows.tolist()]
    return units
