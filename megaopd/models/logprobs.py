"""Per-token log-probs of sequences under a megatron model, from vocab-sharded logits.

    lp = token_logprobs_from_shard(logits_BSV, targets_BS, vocab_size, tp_group)   # [b, s] float32
    per_seq = score_sequences(model, cfg, sequences, pg_collection)                # last stage; else None

log p(y) = z_y - m - log sum_v exp(z_v - m), with m the max over the whole vocabulary; each TP rank holds
Vp/tp columns, so m, the sum and z_y are all-reduced over the TP group (MAX, SUM, SUM) and no rank
ever holds the full-vocabulary logits. Megatron's padding columns (index >= vocab_size) are masked to
-inf first: they are not tokens, and HF / SGLang normalize over the real vocabulary only.
Legend: B batch, S sequence, V vocab shard width.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megaopd.models.forward import forward_only
from megaopd.models.hf_config import HFModelConfig


# TODO(models): switch to megaopd.ops.vocab_parallel_logprobs(logits_shard, ids, group) once it lands
# (check `git log -- megaopd/ops`); keep the padding-column mask here if it does not take vocab_size.
@torch.no_grad()
def token_logprobs_from_shard(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, vocab_size: int,
                              tp_group=None) -> torch.Tensor:
    """log softmax(logits)[target] over the full vocabulary, from this rank's vocab shard (float32)."""
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    z = logits_BSV.float()
    width = z.shape[-1]
    start = tp_rank * width
    if start + width > vocab_size:  # this shard holds padding columns
        col = torch.arange(start, start + width, device=z.device)
        z = z.masked_fill(col >= vocab_size, float("-inf"))
    m_BS = z.max(dim=-1).values
    if tp_size > 1:
        dist.all_reduce(m_BS, op=dist.ReduceOp.MAX, group=tp_group)
    sum_BS = torch.exp(z - m_BS.unsqueeze(-1)).sum(dim=-1)
    local = targets_BS.to(z.device) - start
    owned = (local >= 0) & (local < width)
    z_y = torch.gather(z, -1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    z_y = torch.where(owned, z_y, torch.zeros_like(z_y))
    if tp_size > 1:
        dist.all_reduce(sum_BS, op=dist.ReduceOp.SUM, group=tp_group)
        dist.all_reduce(z_y, op=dist.ReduceOp.SUM, group=tp_group)
    return z_y - m_BS - torch.log(sum_BS)


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
