"""Vocab-parallel top-k, gathers at global ids, and the renormalized support KL of LSM.

Top-k: each rank takes the top-min(k, V) of its shard, the R candidate lists ([T, k] each, small) are
all-gathered and merged; log-probs use the full-vocabulary lse (same pass, two [T] all-reduces).

Support KL (LSM, docs/algorithms.md 1.5/1.6) over a per-token support S of global ids:
    pihat(v) = pi(v) / sum_{u in S} pi(u) = exp(z_v) / sum_{u in S} exp(z_u)    (z = logits / T)
    qhat(v)  = exp(lq_v) / sum_{u in S} exp(lq_u)                             (lq: given log-probs)
    L = sum_{v in S} pihat(v) (log pihat(v) - log qhat(v))
The full-vocabulary normalizer cancels in pihat, so only the K support logits are needed: one
all-reduce of [T, K] gathers them (only the owner rank contributes), the rest is plain autograd on
[T, K]; the gradient reaches the logits only at support ids (backward: the owner rank scatters it).

Tests: pytest tests/ops -x.   Tensor-name legend: megaopd/ops/_common.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megaopd.ops._common import (
    all_gather,
    all_reduce_,
    check_same_tokens,
    check_temperature,
    flatten_tokens,
    global_max_log_sumexp,
    group_rank_and_size,
    owned_local_ids,
    resolve_impl,
    shifted,
    token_chunks,
    vocab_range,
)


class _VocabParallelGather(torch.autograd.Function):
    """forward: logits at global ids, all-reduce SUM (only the owner contributes a nonzero);
    backward: each rank scatters the gradient of the ids it owns into its shard, no comm."""

    @staticmethod
    def forward(ctx, logits_TV, ids_TK, group):
        owned_TK, local_TK = owned_local_ids(ids_TK, logits_TV.shape[1], group)
        values_TK = logits_TV.gather(1, local_TK).float().masked_fill_(~owned_TK, 0.0)
        all_reduce_(values_TK, dist.ReduceOp.SUM, group)
        ctx.save_for_backward(owned_TK, local_TK)
        ctx.logits_shape, ctx.logits_dtype = logits_TV.shape, logits_TV.dtype
        return values_TK

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_TK):
        owned_TK, local_TK = ctx.saved_tensors
        grad_TV = torch.zeros(ctx.logits_shape, dtype=ctx.logits_dtype, device=grad_TK.device)
        # accumulate=True: a repeated id in one row gets the sum, as the forward used its logit twice.
        # (index_put_, not scatter_add_: on CPU the latter upcasts a bf16 [T, V] to float32 first.)
        rows_TK = torch.arange(grad_TV.shape[0], device=grad_TV.device).unsqueeze(1).expand_as(local_TK)
        grad_TV.index_put_(
            (rows_TK, local_TK), grad_TK.masked_fill(~owned_TK, 0.0).to(ctx.logits_dtype), accumulate=True
        )
        return grad_TV, None, None


def vocab_parallel_gather(logits, ids, group=None, impl="auto"):
    """The logits (raw, float32) at global ids, identical on every TP rank.

    logits: [..., V] local shard; ids: [..., K] global ids in [0, V*TP) (others give 0).
    Returns [..., K] float32. Differentiable w.r.t. logits (gradient only at the given ids).
    impl: checked like the other ops' but one path serves all: the forward reads K logits per token and the
    backward is one zero-filled [T, V] write plus K scattered adds, already one write per logit.
    """
    resolve_impl(impl, logits)
    check_same_tokens(logits.shape[:-1], ids, "ids", trailing=1)
    logits_TV = flatten_tokens(logits, "logits")
    values_TK = _VocabParallelGather.apply(logits_TV, ids.reshape(-1, ids.shape[-1]).long(), group)
    return values_TK.view(ids.shape)


@torch.no_grad()
def vocab_parallel_topk(logits, k, group=None, temperature=1.0, chunk_size=None, impl="auto"):
    """The k most probable tokens of softmax(logits / temperature) over the full vocabulary.

    logits: [..., V] local shard. Returns (logprobs [..., k] float32, full-vocabulary log-probs sorted
    descending; global_ids [..., k] int64), identical on every TP rank. NOT differentiable (computed
    under no_grad); to train on these ids, feed them to vocab_parallel_gather / _support_kl.
    Ties: across shards the lower global id comes first (a deterministic merge on every rank); within
    one shard, which of several equal logits torch.topk picks is up to torch. Either way the values
    are the exact k largest and the ids are distinct.
    impl="triton": the lse statistics from the stats kernel (_triton.py) in one read, the shard's top-k from
    torch.topk over all tokens at once; "torch": both chunk by chunk.
    """
    temperature = check_temperature(temperature)
    logits_TV = flatten_tokens(logits, "logits")
    T, V = logits_TV.shape
    rank, size = group_rank_and_size(group)
    if not 1 <= k <= V * size:
        raise ValueError(f"top-k needs 1 <= k <= the vocabulary size {V * size}, got k={k}")
    k_local = min(k, V)
    impl = resolve_impl(impl, logits)
    if impl == "triton":
        from megaopd.ops import _triton

        chunk_size = max(T, 1)  # one "chunk": torch.topk allocates only its [T, k] outputs
    chunks = token_chunks(T, V, chunk_size)
    f32 = dict(dtype=torch.float32, device=logits_TV.device)
    max_loc_T, sumexp_loc_T = torch.empty(T, **f32), torch.empty(T, **f32)
    top_raw_TK = torch.empty(T, k_local, **f32)
    top_ids_TK = torch.empty(T, k_local, dtype=torch.long, device=logits_TV.device)
    start, _ = vocab_range(V, rank)
    for sl in chunks:  # one pass: the shard's top-k and its lse stats
        raw_cV = logits_TV[sl]
        values_cK, local_cK = raw_cV.topk(k_local, dim=-1, sorted=False)
        top_raw_TK[sl], top_ids_TK[sl] = values_cK.float(), local_cK + start
        if impl != "triton":
            max_c = raw_cV.amax(dim=-1).float()
            max_loc_T[sl] = max_c
            sumexp_loc_T[sl] = shifted(raw_cV, max_c, temperature).exp_().sum(dim=-1)
    if impl == "triton":
        max_loc_T, sumexp_loc_T = _triton.local_max_sumexp(logits_TV, temperature)
    max_T, log_sumexp_T, _ = global_max_log_sumexp(max_loc_T, sumexp_loc_T, temperature, group)
    # Candidates of all ranks, [T, R * k_local]; order by id, then a stable sort by value keeps the
    # lower id first among equal values, the same on every rank.
    cand_raw_TC = torch.cat(all_gather(top_raw_TK, group), dim=-1)
    cand_ids_TC = torch.cat(all_gather(top_ids_TK, group), dim=-1)
    cand_ids_TC, order_TC = cand_ids_TC.sort(dim=-1, stable=True)
    cand_raw_TC = cand_raw_TC.gather(1, order_TC)
    top_raw_Tk, pick_Tk = cand_raw_TC.sort(dim=-1, descending=True, stable=True)
    top_raw_Tk, pick_Tk = top_raw_Tk[:, :k], pick_Tk[:, :k]
    ids_Tk = cand_ids_TC.gather(1, pick_Tk)
    logprobs_Tk = (top_raw_Tk - max_T.unsqueeze(-1)) / temperature - log_sumexp_T.unsqueeze(-1)
    lead = logits.shape[:-1]
    return logprobs_Tk.view(*lead, k), ids_Tk.view(*lead, k)


def vocab_parallel_support_kl(
    logits_student, support_ids, support_logprobs_ref, group=None, temperature=1.0, support_mask=None, impl="auto"
):
    """Reverse KL(pihat || qhat) with both renormalized over the support S (LSM).

    logits_student: [..., V] local shard; support_ids: [..., K] global ids; support_logprobs_ref: [..., K]
    log-probs of the reference/teacher at those ids (any normalization: they are renormalized over S);
    support_mask: optional [..., K], true = in S (masked entries may hold any id and any value).
    temperature applies to the student logits only (the reference log-probs come as given).
    Returns [...] float32; a token with an empty support gives 0. Differentiable w.r.t. the student
    logits (gradient only at support ids) and w.r.t. support_logprobs_ref if it requires grad.
    impl: as vocab_parallel_gather's (one path: nothing here reads the whole vocabulary).
    """
    temperature = check_temperature(temperature)
    check_same_tokens(logits_student.shape[:-1], support_ids, "support_ids", trailing=1)
    if support_logprobs_ref.shape != support_ids.shape:
        raise ValueError(
            f"support_logprobs_ref {tuple(support_logprobs_ref.shape)} must match support_ids "
            f"{tuple(support_ids.shape)}"
        )
    mask = torch.ones_like(support_ids, dtype=torch.bool) if support_mask is None else support_mask.bool()
    if mask.shape != support_ids.shape:
        raise ValueError(f"support_mask {tuple(mask.shape)} must match support_ids {tuple(support_ids.shape)}")
    # Masked entries may point anywhere (e.g. -1): gather id 0 there instead, its value is then ignored.
    ids = torch.where(mask, support_ids.long(), torch.zeros_like(support_ids, dtype=torch.long))
    raw_TK = vocab_parallel_gather(logits_student, ids, group, impl).reshape(-1, ids.shape[-1])
    mask_TK = mask.reshape(raw_TK.shape)
    log_pihat_TK = _log_renormalized(raw_TK, mask_TK, temperature)
    log_qhat_TK = _log_renormalized(support_logprobs_ref.reshape(raw_TK.shape).float(), mask_TK, 1.0)
    # Masked entries: log-hats are 0 there, and torch.where (not a product) keeps them out of the sum.
    kl_TK = torch.where(mask_TK, log_pihat_TK.exp() * (log_pihat_TK - log_qhat_TK), torch.zeros_like(raw_TK))
    return kl_TK.sum(dim=-1).view(support_ids.shape[:-1])


def _log_renormalized(x_TK, mask_TK, temperature):
    """log softmax(x / temperature) over the unmasked entries of each row; 0 at masked entries.

    Everything stays finite (masked values may be NaN or inf, rows may be empty), so no inf - inf and
    no NaN gradient. The row max (raw units, constant: it cancels) is subtracted before dividing by the
    temperature, which keeps logits of ~1e4 accurate near the max.
    """
    empty_T1 = ~mask_TK.any(dim=-1, keepdim=True)
    max_T1 = x_TK.detach().masked_fill(~mask_TK, float("-inf")).amax(dim=-1, keepdim=True)
    max_T1 = max_T1.masked_fill(empty_T1, 0.0)
    y_TK = (torch.where(mask_TK, x_TK, max_T1) - max_T1) / temperature  # masked entries: 0
    # Masked entries leave the lse via -inf, except in empty rows (there: all zeros, a finite dummy).
    lse_T1 = torch.logsumexp(y_TK.masked_fill(~mask_TK & ~empty_T1, float("-inf")), dim=-1, keepdim=True)
    return torch.where(mask_TK, y_TK - lse_T1, torch.zeros_like(y_TK))
