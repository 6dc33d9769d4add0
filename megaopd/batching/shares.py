"""Data-parallel shares: which rows each data-parallel replica takes (contiguous blocks, or packing units
balanced by tokens and attention cost).

Pure functions of the row counts (and lengths): every rank computes the same shares, and a resumed run too.
"""
from __future__ import annotations

import heapq
from typing import Sequence


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
