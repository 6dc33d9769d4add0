"""Vocab-parallel log-sum-exp, log-probs of given tokens, and entropy, from TP-sharded logits.

With z = logits / temperature over the full vocabulary (sharded over TP ranks, never gathered):
    lse(t)        = log sum_v exp z_v
    logprob(t)    = z_{id_t} - lse(t)
    entropy(t)    = -sum_v p_v log p_v = lse(t) - sum_v p_v z_v,        p = softmax(z)
Gradients (w.r.t. the logits, hence the 1/temperature):
    d lse / d z_v = p_v;   d logprob / d z_v = 1[v = id_t] - p_v;   d entropy / d z_v = -p_v (log p_v + H)
Forward: one chunked pass over the shard, then two small all-reduces over [T] (MAX, then SUM).
Backward: no communication; softmax recomputed chunk by chunk from the saved logits and (max, log S).
Outputs are float32 whatever the logits' dtype; gradients come back in the logits' dtype.
impl="triton" (the default on CUDA): the same formulas from Triton kernels, one read of the shard forward,
one read and one write backward, the ranks' partials combined by one all-gather (_triton.py, _kernels.py).

Tests: pytest tests/ops -x  (multi-process TP=2/4 checks are marked slow).
Tensor-name legend: see megaopd/ops/_common.py.
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
    global_max_log_sumexp,
    local_max_sumexp,
    log_softmax_chunk,
    owned_local_ids,
    resolve_impl,
    shifted,
    token_chunks,
)


class _VocabParallelLogSumExp(torch.autograd.Function):
    """forward: per-token full-vocab lse (MAX + SUM all-reduce); backward: softmax * grad, no comm."""

    @staticmethod
    def forward(ctx, logits_TV, group, temperature, chunk_size):
        chunks = token_chunks(logits_TV.shape[0], logits_TV.shape[1], chunk_size)
        max_loc_T, sumexp_loc_T = local_max_sumexp(logits_TV, temperature, chunks)
        max_T, log_sumexp_T, _ = global_max_log_sumexp(max_loc_T, sumexp_loc_T, temperature, group)
        ctx.save_for_backward(logits_TV, max_T, log_sumexp_T)
        ctx.temperature, ctx.chunks = temperature, chunks
        return max_T / temperature + log_sumexp_T

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_T):
        logits_TV, max_T, log_sumexp_T = ctx.saved_tensors
        grad_TV = torch.empty_like(logits_TV)
        g_T = grad_T.float() / ctx.temperature  # d z / d logits = 1 / temperature
        for sl in ctx.chunks:
            p_cV = log_softmax_chunk(logits_TV[sl], max_T[sl], log_sumexp_T[sl], ctx.temperature).exp_()
            grad_TV[sl] = p_cV.mul_(g_T[sl].unsqueeze(-1))
        return grad_TV, None, None, None


class _VocabParallelLogProbs(torch.autograd.Function):
    """forward: log-softmax at global ids; the target logit travels in the lse's SUM all-reduce
    (only its owner contributes). backward: (onehot - softmax) * grad, no comm."""

    @staticmethod
    def forward(ctx, logits_TV, ids_T, group, temperature, chunk_size):
        T, V = logits_TV.shape
        chunks = token_chunks(T, V, chunk_size)
        owned_T, local_ids_T = owned_local_ids(ids_T, V, group)
        max_loc_T, sumexp_loc_T = local_max_sumexp(logits_TV, temperature, chunks)
        target_T = logits_TV.gather(1, local_ids_T.unsqueeze(1)).squeeze(1).float()
        target_T = target_T.masked_fill(~owned_T, 0.0)
        max_T, log_sumexp_T, (target_T,) = global_max_log_sumexp(max_loc_T, sumexp_loc_T, temperature, group, target_T)
        ctx.save_for_backward(logits_TV, owned_T, local_ids_T, max_T, log_sumexp_T)
        ctx.temperature, ctx.chunks = temperature, chunks
        return (target_T - max_T) / temperature - log_sumexp_T

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_T):
        logits_TV, owned_T, local_ids_T, max_T, log_sumexp_T = ctx.saved_tensors
        grad_TV = torch.empty_like(logits_TV)
        g_T = grad_T.float() / ctx.temperature
        onehot_T = g_T.masked_fill(~owned_T, 0.0)  # the +1[v = id] term, on the owner rank only
        for sl in ctx.chunks:
            p_cV = log_softmax_chunk(logits_TV[sl], max_T[sl], log_sumexp_T[sl], ctx.temperature).exp_()
            d_cV = p_cV.mul_(-g_T[sl].unsqueeze(-1))
            d_cV.scatter_add_(1, local_ids_T[sl].unsqueeze(1), onehot_T[sl].unsqueeze(1))
            grad_TV[sl] = d_cV
        return grad_TV, None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """forward: H = log S - E_p[(raw - M)/temperature]; each shard sends its sum exp and its
    sum exp * shifted logit (relative to its own max), rescaled after the MAX all-reduce.
    backward: -p (log p + H) * grad, no comm."""

    @staticmethod
    def forward(ctx, logits_TV, group, temperature, chunk_size):
        T, V = logits_TV.shape
        chunks = token_chunks(T, V, chunk_size)
        max_loc_T = torch.empty(T, dtype=torch.float32, device=logits_TV.device)
        sumexp_loc_T, xexp_loc_T = torch.empty_like(max_loc_T), torch.empty_like(max_loc_T)
        for sl in chunks:
            raw_cV = logits_TV[sl]
            max_c = raw_cV.amax(dim=-1).float()
            x_cV = shifted(raw_cV, max_c, temperature)
            e_cV = x_cV.exp()
            max_loc_T[sl], sumexp_loc_T[sl] = max_c, e_cV.sum(dim=-1)
            xexp_loc_T[sl] = e_cV.mul_(x_cV).sum(dim=-1)
        max_T, shift_T, scale_T = global_max(max_loc_T, temperature, group)
        # sum_v e^(x_v + shift) (x_v + shift) = scale * (sum e^x x + shift * sum e^x), x relative to m_r
        sums_2T = all_reduce_(
            torch.stack([scale_T * sumexp_loc_T, scale_T * (xexp_loc_T + shift_T * sumexp_loc_T)]),
            dist.ReduceOp.SUM,
            group,
        )
        log_sumexp_T = sums_2T[0].log()
        entropy_T = log_sumexp_T - sums_2T[1] / sums_2T[0]
        ctx.save_for_backward(logits_TV, max_T, log_sumexp_T, entropy_T)
        ctx.temperature, ctx.chunks = temperature, chunks
        return entropy_T

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_T):
        logits_TV, max_T, log_sumexp_T, entropy_T = ctx.saved_tensors
        grad_TV = torch.empty_like(logits_TV)
        g_T = grad_T.float() / ctx.temperature
        for sl in ctx.chunks:
            logp_cV = log_softmax_chunk(logits_TV[sl], max_T[sl], log_sumexp_T[sl], ctx.temperature)
            p_cV = logp_cV.exp()
            d_cV = logp_cV.add_(entropy_T[sl].unsqueeze(-1)).mul_(p_cV).mul_(-g_T[sl].unsqueeze(-1))
            grad_TV[sl] = d_cV
        return grad_TV, None, None, None


def vocab_parallel_logsumexp(logits, group=None, temperature=1.0, chunk_size=None, impl="auto"):
    """Per-token log sum_v exp(logits_v / temperature) over the full vocabulary.

    logits: [..., V] local shard; returns [...] float32, identical on every TP rank. Differentiable.
    impl: "auto" (Triton kernels on CUDA, torch otherwise) | "triton" (_triton.py; chunk_size unused) | "torch".
    """
    return _per_token("logsumexp", logits, None, group, temperature, chunk_size, impl)


def vocab_parallel_logprobs(logits, ids, group=None, temperature=1.0, chunk_size=None, impl="auto"):
    """log softmax(logits / temperature) over the full vocabulary, at global token ids.

    logits: [..., V] local shard (rank r owns ids [r*V, (r+1)*V)); ids: [...] int64 GLOBAL ids in
    [0, V*TP) (ids outside that range give a meaningless value: mask such tokens afterwards).
    Returns [...] float32, identical on every TP rank. Differentiable w.r.t. logits.
    chunk_size: tokens processed at a time (None: sized so one float32 [chunk, V] is 128 MiB).
    impl: "auto" (Triton kernels on CUDA, torch otherwise) | "triton" (_triton.py; chunk_size unused) | "torch".
    """
    return _per_token("logprobs", logits, ids, group, temperature, chunk_size, impl)


def vocab_parallel_entropy(logits, group=None, temperature=1.0, chunk_size=None, impl="auto"):
    """Per-token entropy -sum_v p_v log p_v of p = softmax(logits / temperature), full vocabulary.

    logits: [..., V] local shard; returns [...] float32. Differentiable w.r.t. logits.
    impl: "auto" (Triton kernels on CUDA, torch otherwise) | "triton" (_triton.py; chunk_size unused) | "torch".
    """
    return _per_token("entropy", logits, None, group, temperature, chunk_size, impl)


_TORCH_OPS = {
    "logsumexp": _VocabParallelLogSumExp,
    "logprobs": _VocabParallelLogProbs,
    "entropy": _VocabParallelEntropy,
}
"""Each op's torch autograd function; the Triton path takes the op's name (_triton.SoftmaxOp)."""


def _per_token(op: str, logits, ids, group, temperature, chunk_size, impl):
    """The one dispatch of the three ops: checks, the tokens flattened to T, the Triton kernels or the torch
    function, the result back in the logits' leading shape. ids: the tokens of "logprobs", else None."""
    temperature = check_temperature(temperature)
    if ids is not None:
        check_same_tokens(logits.shape[:-1], ids, "ids")
    logits_TV = flatten_tokens(logits, "logits")
    ids_T = () if ids is None else (ids.reshape(-1).long(),)
    if resolve_impl(impl, logits) == "triton":
        from megaopd.ops import _triton

        out_T = _triton.SoftmaxOp.apply(logits_TV, *(ids_T or (None,)), group, temperature, op)
    else:
        out_T = _TORCH_OPS[op].apply(logits_TV, *ids_T, group, temperature, chunk_size)
    return out_T.view(logits.shape[:-1])
