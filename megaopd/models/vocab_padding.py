"""Megatron pads the vocabulary (embedding and output layer) to a multiple of 128 * TP; the padding
columns are not tokens. HF and SGLang normalize over the real vocabulary only, so every softmax over
megatron's logits masks them first (the ops take no vocabulary size).

    logits_BSv = mask_vocab_padding(logits_BSv, vocab_size, tp_group)

Legend: B batch, S sequence, v this rank's vocab shard width.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# Logit of padding columns: exp() of it minus any real max is exactly 0, yet it is finite, so a shard made
# only of padding still has a finite local max (-inf - -inf is NaN in the log-sum-exp rescaling) and
# p * log p terms stay 0 * finite (entropy, KL). -1e30 rather than finfo.min, which can overflow to -inf
# once a max is subtracted; float16 (max 65504) gets its own lowest value.
PAD_LOGIT = -1e30


def mask_vocab_padding(logits_BSv: torch.Tensor, vocab_size: int, tp_group=None,
                       inplace: bool = False) -> torch.Tensor:
    """This rank's logits shard with megatron's padding columns (global id >= vocab_size) set to
    PAD_LOGIT, so every softmax over the shard ignores them. Returns the input when the shard has no
    padding columns.

    inplace: mask the given tensor itself instead of a masked copy, which would be a second logits-sized
    tensor while the caller still holds the model's output (the pipeline runner does, through the loss). The
    write goes through `.data`, unseen by autograd: recorded, an in-place write on the model's output (a
    transposed view) would cost two logits-sized buffers in backward (CopySlices and the masked gradient),
    and a write through detach() bumps the version a view's grad_fn is replayed from (torch 2.13 crashes in
    register_hook then). A gradient hook zeroes the padding columns of the incoming gradient, as
    masked_fill's backward would. This is sound because nothing saves the model's output for backward
    (megatron's output layer saves its input and weight), and the ops read the logits only after the write."""
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    width = logits_BSv.shape[-1]
    start = tp_rank * width
    if start + width <= vocab_size:
        return logits_BSv
    col = torch.arange(start, start + width, device=logits_BSv.device)
    fill = max(PAD_LOGIT, torch.finfo(logits_BSv.dtype).min)
    padding = col >= vocab_size
    if not inplace:
        return logits_BSv.masked_fill(padding, fill)
    logits_BSv.data.masked_fill_(padding, fill)
    if logits_BSv.requires_grad:
        logits_BSv.register_hook(lambda grad: grad.masked_fill(padding, 0.0))
    return logits_BSv
