"""Aggregation of per-token losses into one scalar, exact under gradient accumulation and data parallelism.

With l_t the per-token loss, m_t the loss mask, s(t) the sequence of token t, N the loss tokens and
M the sequences (with >= 1 loss token) of the WHOLE step (all micro-batches, all DP ranks):

    token-mean            L = sum_t m_t l_t / N
    seq-mean-token-mean   L = sum_s ( sum_{t in s} m_t l_t / sum_{t in s} m_t ) / M
    seq-mean-token-sum    L = sum_s sum_{t in s} m_t l_t / M

Each micro-batch returns its share (local sums over the global N or M), so summing the micro-batch
gradients over a step, and over DP ranks, gives exactly the one-big-batch gradient. seq-mean-token-mean
needs every sequence whole within one micro-batch (its own token count is the inner denominator).
Departure from verl: no "seq-mean-token-sum-norm" (a constant rescale of seq-mean-token-sum).
With megatron's schedule, use calculate_per_token_loss semantics (the schedule must neither divide the
loss by the number of micro-batches nor average gradients over DP): the counts already do it.

    pytest tests/losses -k "micro_batches or dp_aggregation or aggregation"
"""

from __future__ import annotations

from typing import Callable

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def check_aggregation(value: str) -> None:
    if value not in AGGREGATIONS:
        raise ValueError(f"aggregation={value!r} is not one of {AGGREGATIONS}; pick one of them")


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    seq_ids_BT: torch.Tensor | Callable[[], torch.Tensor],
    num_seqs: int | Callable[[], int],
    mode: str,
    global_num_tokens=None,
    global_num_seqs=None,
) -> torch.Tensor:
    """The micro-batch's share of the step loss (see module docstring); a 0-dim tensor.

    seq_ids_BT and num_seqs may be callables (LossInputs.seq_ids, LossInputs.num_seqs): only the sequence
    modes call them, since counting the sequences of a packed micro-batch reads a device value on the host,
    and token-mean, the default, needs neither (a loss's kernels are issued one by one by the host: at small
    micro-batches that, not the GPU, sets its time).

    Global counts left as None default to this micro-batch's own counts. A count of 0 (no loss token
    anywhere) is treated as 1 so that an empty batch gives loss 0 and zero gradients, not NaN.
    """
    # where() rather than a product: a masked position's loss may be inf/NaN (e.g. padding), and
    # NaN * 0 = NaN would leak into the sum and its gradient.
    masked_BT = torch.where(mask_BT.bool(), loss_BT, 0.0)
    # Local counts stay tensors (a .item() here would stall the GPU in every loss term of every micro-batch),
    # and are made only when the global ones are missing.
    if mode == "token-mean":
        n = global_num_tokens if global_num_tokens is not None else mask_BT.to(loss_BT.dtype).sum()
        return masked_BT.sum() / _at_least_one(n)
    mask = mask_BT.to(loss_BT.dtype)
    if mode not in AGGREGATIONS:
        check_aggregation(mode)
    num_seqs = num_seqs() if callable(num_seqs) else num_seqs
    seq_flat = (seq_ids_BT() if callable(seq_ids_BT) else seq_ids_BT).reshape(-1)
    sums_S = loss_BT.new_zeros(num_seqs).index_add(0, seq_flat, masked_BT.reshape(-1))
    if global_num_seqs is None:
        counts_S = mask.new_zeros(num_seqs).index_add(0, seq_flat, mask.reshape(-1).detach())
        global_num_seqs = (counts_S > 0).sum().to(mask.dtype)
    if mode == "seq-mean-token-sum":
        return sums_S.sum() / _at_least_one(global_num_seqs)
    counts_S = mask.new_zeros(num_seqs).index_add(0, seq_flat, mask.reshape(-1).detach())
    per_seq_S = sums_S / counts_S.clamp(min=1)
    return per_seq_S.sum() / _at_least_one(global_num_seqs)


def _at_least_one(n):
    if isinstance(n, torch.Tensor):
        return n.clamp(min=1)
    return max(float(n), 1.0)


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean of x over the local mask (a metric: detached, 0 when the mask is empty)."""
    x = x_BT.detach()
    m = mask_BT.bool()
    n = m.sum()
    return torch.where(m, x, torch.zeros_like(x)).sum() / n.clamp(min=1)


def masked_means(named: dict[str, torch.Tensor], mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """masked_mean of several [B, T] tensors over one mask, in one pass: a loss's metrics are computed for
    every micro-batch, and five small kernels each (at small micro-batches the host issuing kernels, not
    the GPU, sets a loss's time) became one stack, one where and one sum for all of them."""
    dtype = named[next(iter(named))].dtype
    for x in named.values():
        dtype = torch.promote_types(dtype, x.dtype)
    m = mask_BT.bool()
    x_KBT = torch.stack([x.detach().to(dtype) for x in named.values()])
    means_K = torch.where(m, x_KBT, 0.0).flatten(1).sum(-1) / m.sum().clamp(min=1)
    return dict(zip(named, means_K.unbind()))


def masked_max(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Max of x over the local mask (a metric: detached, 0 when the mask is empty)."""
    x = x_BT.detach()
    m = mask_BT.bool()
    top = torch.where(m, x, torch.full_like(x, float("-inf"))).amax()
    return torch.where(m.any(), top, torch.zeros_like(top))
