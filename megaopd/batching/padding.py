"""Padding of row tensors: equal-shaped micro-batches (megatron's pipeline buffers need one [R, S] shape)."""

from __future__ import annotations

import torch


def pad_rows(x: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    """x with extra rows of `value` so that it has `rows` rows (equal-shaped micro-batches)."""
    if x.shape[0] == rows:
        return x
    pad = torch.full((rows - x.shape[0], *x.shape[1:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad])


def pad_to(x: torch.Tensor, length: int, value=0) -> torch.Tensor:
    """[rows, L(, K)] -> [rows, length(, K)] along dim 1."""
    if x.shape[1] == length:
        return x
    pad = torch.full((x.shape[0], length - x.shape[1], *x.shape[2:]), value, dtype=x.dtype)
    return torch.cat([x, pad], dim=1)
