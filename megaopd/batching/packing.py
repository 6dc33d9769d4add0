"""Packed rows: several sequences in one [1, t] row (THD), cut by a token budget.

    shares = balanced_partition(unit_costs, dp_size)                 # which units each DP rank takes (shares.py)
    bins = pack_by_budget([sum(lengths of u) for u in units], budget) # which units share a micro-batch
    row = PackedRow([Segment(source=0, row=b, length=L) ...], total)  # one micro-batch's layout
    row.tokens({0: tokens_BS}, pad_id)  -> [1, total]                 row.cu_seqlens -> int32 [n + 1]
    row.per_token(x_BT, source=0)       -> [1, total - 1, ...]        row.unpack(y_1T) -> per segment

A packed row lays its segments end to end and, when `total` exceeds their sum, a padding segment after
them (its own sequence: attention never crosses a segment, so padding changes nothing else). Position p of
a [1, total - 1] tensor is about the token at p + 1, as in the padded layout; the last position of each
segment would predict the next segment's first token, so it maps to nothing (fill) and its masks are 0.
A segment of length L at offset o maps position o + t to position t of its source row, t < L - 1.

Everything here is a pure function of the lengths: every rank of a model-parallel group makes the same
micro-batches, and a resumed run makes the same partition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

ON_POLICY, GOLDEN = 0, 1  # the two sources of a training micro-batch's segments (rollout rows, golden rows)


@dataclass(frozen=True)
class Segment:
    """One sequence of a packed row: `length` tokens of row `row` of source `source`."""

    source: int
    """Which source tensor family the segment's data comes from (e.g. 0 on-policy, 1 golden)."""
    row: int
    """Row of that source."""
    length: int
    """Real tokens (>= 1)."""


class PackedRow:
    """The layout of one packed micro-batch (see the module docstring)."""

    def __init__(self, segments: Sequence[Segment], total: int | None = None):
        self.segments = list(segments)
        used = sum(s.length for s in self.segments)
        self.total = used if total is None else total
        if self.total < used or any(s.length < 1 for s in self.segments):
            raise ValueError(
                f"packed row of {self.total} tokens cannot hold segments of lengths {[s.length for s in self.segments]}"
            )
        lengths = [s.length for s in self.segments] + ([self.total - used] if self.total > used else [])
        self.num_seqs = len(lengths)
        """Segments plus the padding segment, if any: the sequence ids of seq_ids() run over [0, num_seqs)."""
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        self.offsets = offsets
        self.cu_seqlens = torch.tensor(offsets, dtype=torch.int32)
        self.max_seqlen = max(lengths) if lengths else 0
        # Gather index of every position: (segment, t) or -1.
        T = max(self.total - 1, 0)
        seg_P = torch.full((T,), -1, dtype=torch.long)
        t_P = torch.zeros(T, dtype=torch.long)
        for i, s in enumerate(self.segments):
            o = offsets[i]
            seg_P[o : o + s.length - 1] = i
            t_P[o : o + s.length - 1] = torch.arange(s.length - 1)
        self._seg_P, self._t_P = seg_P, t_P

    def tokens(self, sources: dict[int, torch.Tensor], pad_id: int) -> torch.Tensor:
        """[1, total] long: every segment's first `length` tokens of its source's [rows, S] tensor."""
        out = torch.full((1, self.total), pad_id, dtype=torch.long)
        for i, s in enumerate(self.segments):
            out[0, self.offsets[i] : self.offsets[i] + s.length] = sources[s.source][s.row, : s.length]
        return out

    def per_token(self, x_BT: torch.Tensor, source: int = 0, fill=0) -> torch.Tensor:
        """[1, total - 1, ...]: x_BT[row, t] of this source's segments at their positions, `fill` elsewhere."""
        out = torch.full((self._seg_P.numel(), *x_BT.shape[2:]), fill, dtype=x_BT.dtype)
        pick = torch.tensor([i for i, s in enumerate(self.segments) if s.source == source], dtype=torch.long)
        if pick.numel():
            rows = torch.tensor([s.row for s in self.segments], dtype=torch.long)
            where = torch.isin(self._seg_P, pick)
            t = self._t_P[where]
            if t.numel() and int(t.max()) >= x_BT.shape[1]:
                raise ValueError(f"a segment is longer than its source's {x_BT.shape[1] + 1} tokens")
            out[where] = x_BT[rows[self._seg_P[where]], t]
        return out.unsqueeze(0)

    def seq_ids(self) -> torch.Tensor:
        """[1, total - 1] long: the sequence (segment, then padding segment) of every position."""
        bounds = self.cu_seqlens[1:-1].long()
        return torch.bucketize(torch.arange(self._seg_P.numel()), bounds, right=True).unsqueeze(0)

    def position_ids(self) -> torch.Tensor:
        """[1, total] long: positions restart at 0 in every sequence (RoPE per sequence)."""
        starts = torch.repeat_interleave(self.cu_seqlens[:-1].long(), torch.diff(self.cu_seqlens).long())
        return (torch.arange(self.total) - starts).unsqueeze(0)

    def unpack(self, y_1T: torch.Tensor) -> list[torch.Tensor]:
        """Per segment, its L - 1 positions of a [1, total - 1, ...] result."""
        return [y_1T[0, self.offsets[i] : self.offsets[i] + s.length - 1] for i, s in enumerate(self.segments)]


def pack_by_budget(unit_tokens: Sequence[int], budget: int) -> list[list[int]]:
    """Units (a sequence, or a GRPO group kept whole) into micro-batches of at most `budget` tokens:
    first-fit decreasing (longest first, ties by index; each unit into the first micro-batch it fits).
    A unit longer than the budget gets a micro-batch of its own. Deterministic; the units of each
    micro-batch come back in index order."""
    if budget < 1:
        raise ValueError(f"trainer.max_tokens_per_micro_batch={budget} must be at least 1")
    order = sorted(range(len(unit_tokens)), key=lambda i: (-unit_tokens[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = unit_tokens[i]
        for j, load in enumerate(loads):
            if load + n <= budget:
                bins[j].append(i)
                loads[j] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return [sorted(b) for b in bins]


def row_lengths(tokens_BS: torch.Tensor, lengths_B: torch.Tensor | None) -> list[int]:
    """Real tokens per row: lengths_B, else the whole padded width."""
    if lengths_B is None:
        return [tokens_BS.shape[1]] * tokens_BS.shape[0]
    return [max(1, int(n)) for n in lengths_B.tolist()]


def round_up(n: int, multiple: int) -> int:
    """The least multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple
