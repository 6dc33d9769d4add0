"""Per-token log-probs of sequences under a megatron model, from vocab-sharded logits.

    lp = token_logprobs_from_shard(logits_BSV, targets_BS, vocab_size, tp_group)   # [b, s] float32
    per_seq = score_sequences(model, cfg, sequences, pg_collection)                # last stage; else None

Each TP rank holds Vp/tp columns of the logits; megaopd.ops.vocab_parallel_logprobs normalizes over the
whole vocabulary with TP all-reduces, so no rank ever holds full-vocabulary logits. Megatron's padding
columns (index >= vocab_size) are masked first: they are not tokens, and HF / SGLang normalize over the
real vocabulary only (the ops take no vocab size, so every caller on megatron logits must mask).
Legend: B batch, S sequence, V vocab shard width.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megaopd.models.forward import forward_only
from megaopd.models.hf_config import HFModelConfig


# Logit of padding columns: exp() of it minus any real max is exactly 0, yet it is finite, so a shard made
# only of padding still has a finite local max (-inf - -inf is NaN in the log-sum-exp rescaling) and
# p * log p terms stay 0 * finite (entropy, KL). -1e30 rather than finfo.min, which can overflow to -inf
# once a max is subtracted; float16 (max 65504) gets its own lowest value.
PAD_LOGIT = -1e30


def mask_vocab_padding(logits_BSV: torch.Tensor, vocab_size: int, tp_group=None) -> torch.Tensor:
    """This rank's logits shard with megatron's padding columns (global id >= vocab_size) set to
    PAD_LOGIT, so every softmax over the shard ignores them. Returns the input when the shard has no
    padding columns."""
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    width = logits_BSV.shape[-1]
    start = tp_rank * width
    if start + width <= vocab_size:
        return logits_BSV
    col = torch.arange(start, start + width, device=logits_BSV.device)
    return logits_BSV.masked_fill(col >= vocab_size, max(PAD_LOGIT, torch.finfo(logits_BSV.dtype).min))


def token_logprobs_from_shard(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, vocab_size: int,
                              tp_group=None) -> torch.Tensor:
    """log softmax(logits)[target] over the real vocabulary, from this rank's vocab shard ([b, s] float32)."""
    from megaopd.ops import vocab_parallel_logprobs

    return vocab_parallel_logprobs(mask_vocab_padding(logits_BSV, vocab_size, tp_group),
                                   targets_BS.to(logits_BSV.device), group=tp_group)


def score_sequences(model, cfg: HFModelConfig, sequences: Sequence[Sequence[int]], pg_collection=None,
                    micro_batch_size: int = 4, pad_id: int = 0) -> list[list[float]] | None:
    """log p(x_{i+1} | x_0..x_i) for each sequence (len - 1 values each).

    Collective over the model's layout. Sequences are right-padded to one length (causal attention
    keeps real positions unaffected) and grouped in micro-batches. Returns the lists on the last
    pipeline stage (every TP rank), None elsewhere.
    """
    from megaopd.models import compat

    pgs = compat.resolve_pg_collection(pg_collection)
    n = len(sequences)
    if n == 0:
        return []
    s = max(len(x) for x in sequences)
    mbs = max(1, min(micro_batch_size, n))
    n_batches = -(-n // mbs)
    ids = torch.full((n_batches * mbs, s), pad_id, dtype=torch.long)
    for i, x in enumerate(sequences):
        ids[i, : len(x)] = torch.as_tensor(list(x), dtype=torch.long)
    batches = [{"input_ids": ids[j * mbs:(j + 1) * mbs]} for j in range(n_batches)]

    def on_logits(logits_BSV, batch):
        x = batch["input_ids"]
        lp = token_logprobs_from_shard(logits_BSV[:, :-1], x[:, 1:], cfg.vocab_size, pgs.tp)
        return lp.cpu()

    results = forward_only(model, batches, pgs, on_logits)
    if pgs.pp.rank() != pgs.pp.size() - 1:
        return None
    lp_all = torch.cat(results, dim=0)
    return [lp_all[i, : len(x) - 1].tolist() for i, x in enumerate(sequences)]
