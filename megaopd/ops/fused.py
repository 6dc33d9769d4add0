"""Fused vocab-parallel log-probs + KL to a frozen reference (+ entropy metric): one pass, one backward.

Stable-OPD's student term needs, from the same student logits, the log-prob of the sampled token (policy
and SFT terms), the exact KL(p||q) to the frozen reference (ref_kl) and, as a metric, the entropy of p.
The separate ops make three passes over the logits and two backward passes whose [T, V] gradients
autograd then adds out of place; this op makes one of each. With z = logits / temperature,
p = softmax(zp), q = softmax(zq) over the full vocabulary (sharded over TP, never gathered):
    logprob(t) = zp_{id_t} - lse_p(t)
    KL(t)      = sum_v p_v (log p_v - log q_v)
    H(t)       = -sum_v p_v log p_v                                            (metric: no gradient)
Gradient w.r.t. the student logits for upstream gradients a = dL/dKL, b = dL/dlogprob (per token):
    dL / d zp_v = a p_v (log p_v - log q_v - KL) + b (1[v = id_t] - p_v)
                = p_v (a (log p_v - log q_v) - a KL - b) + b 1[v = id_t]
written chunk by chunk straight into ONE [T, V] buffer (d z / d logits = 1 / temperature). q is the
frozen reference: it gets no gradient (the op refuses a logits_q that requires grad: detach it).

Forward: one chunked pass over both shards; all-reduces MAX [2, T] (both maxima) and one SUM [4 or 5, T]
(sum exp p, sum exp q, sum exp p (xp - xq), the target logit from its owner rank, and for the entropy
sum exp p * xp). Backward: no communication; log p and log q recomputed from the saved logits and
per-token (max, log S). Outputs float32; the gradient comes back in the logits' dtype. Numerics as the
other ops (_common.py): maxima subtracted before the temperature, float32 accumulation, sums kept relative
to the shard's own max until the all-reduce (finite for logits ~1e4 and padding columns at -1e30).

impl="triton" (the default on CUDA; _triton.PairOp): the same formulas from Triton kernels, one read of both
shards forward (partials of all ranks combined by one all-gather), one read of both and one write of the
gradient (in the logits' dtype, into q's memory under overwrite_q) backward: ~10 bytes per bf16 logit.

Tests: pytest tests/ops -x.   Tensor-name legend: megaopd/ops/_common.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megaopd.ops._common import (
    all_reduce_,
    check_same_tokens,
    check_temperature,
    flatten_tokens,
    global_max,
    log_softmax_chunk,
    owned_local_ids,
    resolve_impl,
    shifted,
    token_chunks,
)


class _VocabParallelLogProbsKL(torch.autograd.Function):
    """forward: per-token logprob at ids, KL(p||q) and optionally H(p), from one pass and one MAX + one
    SUM all-reduce; backward: the combined gradient w.r.t. logits_p in one buffer, no comm."""

    @staticmethod
    def forward(ctx, logits_p_TV, ids_T, logits_q_TV, group, temperature, chunk_size, with_entropy, overwrite_q):
        T, V = logits_p_TV.shape
        chunks = token_chunks(T, V, chunk_size)
        f32 = dict(dtype=torch.float32, device=logits_p_TV.device)
        owned_T, local_ids_T = owned_local_ids(ids_T, V, group)
        max_loc_2T = torch.empty(2, T, **f32)  # rows: p, q
        sump_loc_T, sumq_loc_T, diff_loc_T = torch.empty(T, **f32), torch.empty(T, **f32), torch.empty(T, **f32)
        xexp_loc_T = torch.empty(T, **f32) if with_entropy else None
        for sl in chunks:
            rawp_cV, rawq_cV = logits_p_TV[sl], logits_q_TV[sl]
            maxp_c, maxq_c = rawp_cV.amax(dim=-1).float(), rawq_cV.amax(dim=-1).float()
            max_loc_2T[0, sl], max_loc_2T[1, sl] = maxp_c, maxq_c
            xp_cV, xq_cV = shifted(rawp_cV, maxp_c, temperature), shifted(rawq_cV, maxq_c, temperature)
            ep_cV = xp_cV.exp()
            sump_loc_T[sl] = ep_cV.sum(dim=-1)
            if with_entropy:
                xexp_loc_T[sl] = _rowdot(ep_cV, xp_cV)  # sum e^xp xp
            diff_loc_T[sl] = _rowdot(ep_cV, xp_cV.sub_(xq_cV))  # sum e^xp (xp - xq)
            sumq_loc_T[sl] = xq_cV.exp_().sum(dim=-1)
        target_T = logits_p_TV.gather(1, local_ids_T.unsqueeze(1)).squeeze(1).float().masked_fill_(~owned_T, 0.0)
        max_2T, shift_2T, scale_2T = global_max(max_loc_2T, temperature, group)
        # Against the global maxima, zp - Mp - (zq - Mq) = xp - xq + (shift_p - shift_q) on this shard, and
        # zp - Mp = xp + shift_p (see vocab_parallel_kl / vocab_parallel_entropy).
        rows = [
            scale_2T[0] * sump_loc_T,
            scale_2T[1] * sumq_loc_T,
            scale_2T[0] * (diff_loc_T + (shift_2T[0] - shift_2T[1]) * sump_loc_T),
            target_T,
        ]
        if with_entropy:
            rows.append(scale_2T[0] * (xexp_loc_T + shift_2T[0] * sump_loc_T))
        sums_nT = all_reduce_(torch.stack(rows), dist.ReduceOp.SUM, group)
        log_sumexp_p_T, log_sumexp_q_T = sums_nT[0].log(), sums_nT[1].log()
        kl_T = sums_nT[2] / sums_nT[0] - log_sumexp_p_T + log_sumexp_q_T
        logprobs_T = (sums_nT[3] - max_2T[0]) / temperature - log_sumexp_p_T
        entropy_T = log_sumexp_p_T - sums_nT[4] / sums_nT[0] if with_entropy else None
        ctx.save_for_backward(
            logits_p_TV, logits_q_TV, owned_T, local_ids_T, max_2T, log_sumexp_p_T, log_sumexp_q_T, kl_T
        )
        ctx.temperature, ctx.chunks, ctx.overwrite_q = temperature, chunks, overwrite_q
        ctx.set_materialize_grads(False)  # an unused output (e.g. only the KL is in the loss) costs nothing
        if with_entropy:
            ctx.mark_non_differentiable(entropy_T)
        return logprobs_T, kl_T, entropy_T

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs_T, grad_kl_T, _grad_entropy_T):
        logits_p_TV, logits_q_TV, owned_T, local_ids_T, max_2T, log_sumexp_p_T, log_sumexp_q_T, kl_T = ctx.saved_tensors
        temperature = ctx.temperature
        # overwrite_q: the caller drops q after this backward, so its buffer takes the gradient; each chunk of
        # q is read (log q) before the same rows are written, chunks are disjoint. One [T, V] buffer less.
        reuse = (
            ctx.overwrite_q
            and logits_q_TV.dtype == logits_p_TV.dtype
            and logits_q_TV.is_contiguous()
            and logits_q_TV.device == logits_p_TV.device
        )
        grad_TV = logits_q_TV if reuse else torch.empty_like(logits_p_TV)
        direct = grad_TV.dtype == torch.float32  # write each chunk's product straight into grad_TV
        # Per token: a = dL/dKL / temperature, b = dL/dlogprob / temperature; the chunk gradient is
        # p * (a (log p - log q) - c) + b 1[v = id] with c = a KL + b.
        a_T = grad_kl_T.float() / temperature if grad_kl_T is not None else None
        b_T = grad_logprobs_T.float() / temperature if grad_logprobs_T is not None else None
        if a_T is None:
            c_T = b_T
        else:
            c_T = a_T * kl_T if b_T is None else a_T * kl_T + b_T
        onehot_T = b_T.masked_fill(~owned_T, 0.0) if b_T is not None else None  # owner rank only
        for sl in ctx.chunks:
            logp_cV = log_softmax_chunk(logits_p_TV[sl], max_2T[0, sl], log_sumexp_p_T[sl], temperature)
            if a_T is not None:
                d_cV = log_softmax_chunk(logits_q_TV[sl], max_2T[1, sl], log_sumexp_q_T[sl], temperature)
                torch.sub(logp_cV, d_cV, out=d_cV)  # log p - log q
                d_cV.mul_(a_T[sl].unsqueeze(-1)).sub_(c_T[sl].unsqueeze(-1))
                p_cV = logp_cV.exp_()
            else:
                p_cV = logp_cV.exp_()
                d_cV = None
            if direct:
                out_cV = grad_TV[sl]
                if d_cV is None:
                    torch.mul(p_cV, c_T[sl].unsqueeze(-1).neg(), out=out_cV)
                else:
                    torch.mul(p_cV, d_cV, out=out_cV)
            else:
                out_cV = p_cV.mul_(d_cV) if d_cV is not None else p_cV.mul_(c_T[sl].unsqueeze(-1).neg())
            if onehot_T is not None:
                out_cV.scatter_add_(1, local_ids_T[sl].unsqueeze(1), onehot_T[sl].unsqueeze(1))
            if not direct:
                grad_TV[sl] = out_cV
        return grad_TV, None, None, None, None, None, None, None


def _rowdot(a_cV: torch.Tensor, b_cV: torch.Tensor) -> torch.Tensor:
    """sum_v a[c, v] b[c, v] per row (float32). On CPU at full float32 matmul precision a batched
    matrix-vector product, which does not materialize the product (about 2x faster than mul + sum there);
    elsewhere, or when matmuls may round float32 to TF32 / bf16, a plain multiply and sum."""
    if a_cV.device.type == "cpu" and torch.get_float32_matmul_precision() == "highest":
        return torch.bmm(a_cV.unsqueeze(1), b_cV.unsqueeze(2)).view(a_cV.shape[0])
    return (a_cV * b_cV).sum(dim=-1)


def vocab_parallel_logprobs_kl(
    logits_p,
    ids,
    logits_q,
    group=None,
    temperature=1.0,
    chunk_size=None,
    with_entropy=False,
    overwrite_q=False,
    impl="auto",
):
    """(logprobs, kl, entropy) per token in one fused pass over the logits shards (see module docstring).

    logits_p: [..., V] student shard, differentiable; ids: [...] GLOBAL token ids (as in
    vocab_parallel_logprobs); logits_q: [..., V] frozen reference shard of the same layout: it must not
    require grad (pass it detached; no gradient is computed for it). Returns float32 [...] tensors,
    identical on every TP rank: logprobs = log p(ids), kl = KL(p||q) over the full vocabulary, both
    differentiable w.r.t. logits_p with one combined backward pass; entropy = H(p) without gradient if
    with_entropy else None. Equal (to float32 rounding) to vocab_parallel_logprobs(logits_p, ids),
    vocab_parallel_kl(logits_p, logits_q.detach()) and vocab_parallel_entropy(logits_p).
    overwrite_q: the backward writes the gradient into logits_q's memory (when it has logits_p's dtype and
    its flattened view is contiguous, else a copy of it) instead of a new [T, V] buffer, so logits_q holds
    garbage after backward: only for a caller that drops it (the trainer's lockstep reference logits).
    impl: "auto" (Triton kernels on CUDA, torch otherwise) | "triton" (_triton.py: one read of both shards
    forward, one read of both and one write of the gradient backward; chunk_size unused) | "torch".
    """
    temperature = check_temperature(temperature)
    if logits_p.shape != logits_q.shape:
        raise ValueError(
            f"logits_p {tuple(logits_p.shape)} and logits_q {tuple(logits_q.shape)} must have "
            f"the same shape (same tokens, same vocab shard)"
        )
    if logits_q.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "vocab_parallel_logprobs_kl treats logits_q as a frozen reference and computes no "
            "gradient for it: pass logits_q.detach() (or use vocab_parallel_kl for both gradients)"
        )
    check_same_tokens(logits_p.shape[:-1], ids, "ids")
    lead = logits_p.shape[:-1]
    if resolve_impl(impl, logits_p) == "triton":
        from megaopd.ops import _triton

        logprobs_T, kl_T, entropy_T = _triton.PairOp.apply(
            flatten_tokens(logits_p, "logits_p"),
            ids.reshape(-1).long(),
            flatten_tokens(logits_q, "logits_q"),
            group,
            temperature,
            bool(with_entropy),
            bool(overwrite_q),
        )
        return logprobs_T.view(lead), kl_T.view(lead), entropy_T.view(lead) if entropy_T is not None else None
    logprobs_T, kl_T, entropy_T = _VocabParallelLogProbsKL.apply(
        flatten_tokens(logits_p, "logits_p"),
        ids.reshape(-1).long(),
        flatten_tokens(logits_q, "logits_q"),
        group,
        temperature,
        chunk_size,
        bool(with_entropy),
        bool(overwrite_q),
    )
    return logprobs_T.view(lead), kl_T.view(lead), entropy_T.view(lead) if entropy_T is not None else None
