"""Forward-only scoring passes: per-token outputs of a model for every row of the rollout batch.

Each model (actor, teacher) scores the rows of its own data-parallel shard in its own layout; the
small per-token results (a log-prob, K ids + K log-probs, an entropy) are then assembled on EVERY rank,
so that whichever rank trains a sample in the actor layout has its teacher outputs. Assembly is exact:
only the first rank of each model-parallel group (tp_rank = pp_rank = 0) writes its rows into a zero
tensor and the world sums them.

Shape legend: B rows, S padded sequence length, T = S - 1 positions, K top-k size, v vocab shard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from megaopd import ops
from megaopd.trainer.stage_runner import StageRunner, broadcast_from_last_stage


@dataclass
class TokenScores:
    """Per-token outputs of one model on the batch's targets (all rows, every rank)."""

    logprobs_BT: torch.Tensor
    entropy_BT: torch.Tensor | None = None
    topk_ids_BTK: torch.Tensor | None = None
    topk_logprobs_BTK: torch.Tensor | None = None
    at_ids_logprobs_BTK: torch.Tensor | None = None
    """Log-probs at caller-given ids per position (the teacher at the student's top-k)."""


def dp_rows(num_rows: int, pgs: ProcessGroupCollection) -> range:
    """The contiguous block of rows this rank's data-parallel replica handles."""
    dp, r = pgs.dp.size(), pgs.dp.rank()
    per = -(-num_rows // dp)
    return range(min(r * per, num_rows), min((r + 1) * per, num_rows))


def pad_rows(x: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    """x with extra rows of `value` so that it has `rows` rows (equal-shaped micro-batches)."""
    if x.shape[0] == rows:
        return x
    pad = torch.full((rows - x.shape[0], *x.shape[1:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad])


def micro_batches(tokens_BS: torch.Tensor, size: int) -> list[torch.Tensor]:
    n = tokens_BS.shape[0]
    padded = pad_rows(tokens_BS, -(-n // size) * size) if n else tokens_BS
    return list(padded.split(size)) if n else []


def _assemble(local: torch.Tensor | None, rows: range, full_shape, dtype, contributes: bool) -> torch.Tensor:
    full = torch.zeros(full_shape, dtype=dtype)
    if contributes and local is not None and len(rows):
        full[rows.start:rows.stop] = local[: len(rows)].to(dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(full)
    return full


def score_tokens(runner: StageRunner, tokens_BS: torch.Tensor, micro_batch_size: int, temperature: float,
                 topk: int = 0, entropy: bool = False, at_ids_BTK: torch.Tensor | None = None) -> TokenScores:
    """Log-probs of tokens_BS[:, 1:] (and optional top-k, entropy, log-probs at given ids) for all rows."""
    pgs = runner.pgs
    B, S = tokens_BS.shape
    T = S - 1
    rows = dp_rows(B, pgs)
    mbs = micro_batches(tokens_BS[rows.start:rows.stop], micro_batch_size)
    at_ids_local = None
    if at_ids_BTK is not None:
        at_ids_local = pad_rows(at_ids_BTK[rows.start:rows.stop], len(mbs) * micro_batch_size)

    def step_fn(mb, logits_BSv, _partner):
        logits_BTv = logits_BSv[:, :-1].float()
        targets_BT = mb.tokens_BS[:, 1:]
        out = {"logprobs": ops.vocab_parallel_logprobs(logits_BTv, targets_BT, pgs.tp, temperature)}
        if entropy:
            out["entropy"] = ops.vocab_parallel_entropy(logits_BTv, pgs.tp, temperature)
        if topk:
            out["topk_logprobs"], out["topk_ids"] = ops.vocab_parallel_topk(logits_BTv, topk, pgs.tp, temperature)
        if at_ids_local is not None:
            ids = at_ids_local[mb.index * micro_batch_size:(mb.index + 1) * micro_batch_size]
            lse = ops.vocab_parallel_logsumexp(logits_BTv, pgs.tp, temperature)
            out["at_ids"] = ops.vocab_parallel_gather(logits_BTv, ids, pgs.tp) / temperature - lse.unsqueeze(-1)
        return torch.zeros(()), out

    with torch.no_grad():
        results = runner.run(mbs, step_fn, forward_only=True)

    n_local = len(mbs) * micro_batch_size
    first_of_mp = pgs.tp.rank() == 0 and pgs.pp.rank() == 0

    def collect(key, trailing=(), dtype=torch.float32):
        local = torch.cat([r[key] for r in results]) if results else None
        if pgs.pp.size() > 1 and mbs:
            local = broadcast_from_last_stage(local, (n_local, T, *trailing), dtype, pgs.pp)
        return _assemble(local, rows, (B, T, *trailing), dtype, first_of_mp)

    scores = TokenScores(logprobs_BT=collect("logprobs"))
    if entropy:
        scores.entropy_BT = collect("entropy")
    if topk:
        scores.topk_logprobs_BTK = collect("topk_logprobs", (topk,))
        scores.topk_ids_BTK = collect("topk_ids", (topk,), torch.long)
    if at_ids_BTK is not None:
        scores.at_ids_logprobs_BTK = collect("at_ids", (at_ids_BTK.shape[-1],))
    return scores
