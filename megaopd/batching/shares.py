"""Data-parallel shares: which rows each data-parallel replica takes.

Pure functions of the row counts (and lengths): every rank computes the same shares, and a resumed run too.
"""
from __future__ import annotations


def dp_rows(num_rows: int, dp_rank: int, dp_size: int) -> range:
    """The contiguous block of rows data-parallel replica `dp_rank` of `dp_size` handles."""
    per = -(-num_rows // dp_size)
    return range(min(dp_rank * per, num_rows), min((dp_rank + 1) * per, num_rows))
