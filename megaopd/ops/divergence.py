"""Vocab-parallel full-vocabulary divergences between two distributions sharded the same way over TP.

KL (Stable-OPD reference KL; p = student, q = frozen reference), with p = softmax(logits_p / T),
q = softmax(logits_q / T):
    KL(p||q) = sum_v p_v (log p_v - log q_v)
    d KL / d zp_v = p_v (log p_v - log q_v - KL)        d KL / d zq_v = q_v - p_v

Generalized JSD(beta) (GKD, Agarwal et al. 2024, eq. 1; p = student, q = teacher):
    M = beta q + (1 - beta) p,   JSD = beta KL(q||M) + (1 - beta) KL(p||M)
      = beta sum q log q + (1 - beta) sum p log p - sum M log M
    d JSD / d zp_v = (1 - beta) p_v (log p_v - log M_v - KL(p||M))   (teacher: beta, q, KL(q||M))
  The formula is 0 at beta = 0 and at beta = 1. As beta -> 0, JSD ~ beta KL(q||p) and as beta -> 1,
  JSD ~ (1 - beta) KL(p||q); so, as in TRL's GKDTrainer.generalized_jsd_loss (the GKD authors' public
  reference), beta = 0 returns the forward KL(q||p) = KL(teacher||student) and beta = 1 the reverse
  KL(p||q) = KL(student||teacher). Note the jump in scale at the two ends: that is the convention.

KL: one chunked pass over both shards, all-reduce MAX [2, T] and SUM [3, T]. JSD needs the global
log-normalizers before log M can be formed: two passes, all-reduces MAX [2, T], SUM [2, T], SUM [2, T].
Backward: no communication; both softmaxes recomputed chunk by chunk. Outputs are float32.
impl="triton" (the default on CUDA): the same formulas from Triton kernels (_triton.py): KL reads both shards
once forward and once backward, both gradients written in one pass; JSD reads them twice forward.

Tests: pytest tests/ops -x.   Tensor-name legend: megaopd/ops/_common.py.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megaopd.ops._common import (
    all_reduce_,
    check_temperature,
    flatten_tokens,
    global_max,
    global_max_log_sumexp,
    local_max_sumexp,
    log_softmax_chunk,
    resolve_impl,
    shifted,
    token_chunks,
)


class _VocabParallelKL(torch.autograd.Function):
    """forward: KL = E_p[(zp - Mp) - (zq - Mq)] - log Sp + log Sq, each shard's sums taken relative to
    its own maxima and rescaled after one MAX all-reduce; backward: no comm."""

    @staticmethod
    def forward(ctx, logits_p_TV, logits_q_TV, group, temperature, chunk_size):
        T, V = logits_p_TV.shape
        chunks = token_chunks(T, V, chunk_size)
        f32 = dict(dtype=torch.float32, device=logits_p_TV.device)
        max_loc_2T = torch.empty(2, T, **f32)  # rows: p, q
        sump_loc_T, sumq_loc_T, diff_loc_T = torch.empty(T, **f32), torch.empty(T, **f32), torch.empty(T, **f32)
        for sl in chunks:
            rawp_cV, rawq_cV = logits_p_TV[sl], logits_q_TV[sl]
            maxp_c, maxq_c = rawp_cV.amax(dim=-1).float(), rawq_cV.amax(dim=-1).float()
            xp_cV, xq_cV = shifted(rawp_cV, maxp_c, temperature), shifted(rawq_cV, maxq_c, temperature)
            ep_cV = xp_cV.exp()
            max_loc_2T[0, sl], max_loc_2T[1, sl] = maxp_c, maxq_c
            sump_loc_T[sl] = ep_cV.sum(dim=-1)
            diff_loc_T[sl] = ep_cV.mul_(xp_cV.sub_(xq_cV)).sum(dim=-1)  # sum e^xp (xp - xq)
            sumq_loc_T[sl] = xq_cV.exp_().sum(dim=-1)
        max_2T, shift_2T, scale_2T = global_max(max_loc_2T, temperature, group)
        # Against the global maxima, zp - Mp - (zq - Mq) = xp - xq + (shift_p - shift_q) on this shard.
        sums_3T = all_reduce_(
            torch.stack(
                [
                    scale_2T[0] * sump_loc_T,
                    scale_2T[1] * sumq_loc_T,
                    scale_2T[0] * (diff_loc_T + (shift_2T[0] - shift_2T[1]) * sump_loc_T),
                ]
            ),
            dist.ReduceOp.SUM,
            group,
        )
        log_sumexp_p_T, log_sumexp_q_T = sums_3T[0].log(), sums_3T[1].log()
        kl_T = sums_3T[2] / sums_3T[0] - log_sumexp_p_T + log_sumexp_q_T
        ctx.save_for_backward(logits_p_TV, logits_q_TV, max_2T, log_sumexp_p_T, log_sumexp_q_T, kl_T)
        ctx.temperature, ctx.chunks = temperature, chunks
        return kl_T

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_T):
        logits_p_TV, logits_q_TV, max_2T, log_sumexp_p_T, log_sumexp_q_T, kl_T = ctx.saved_tensors
        need_p, need_q = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_p_TV = torch.empty_like(logits_p_TV) if need_p else None
        grad_q_TV = torch.empty_like(logits_q_TV) if need_q else None
        g_T = grad_T.float() / ctx.temperature
        for sl in ctx.chunks:
            g_c1 = g_T[sl].unsqueeze(-1)
            logp_cV = log_softmax_chunk(logits_p_TV[sl], max_2T[0, sl], log_sumexp_p_T[sl], ctx.temperature)
            logq_cV = log_softmax_chunk(logits_q_TV[sl], max_2T[1, sl], log_sumexp_q_T[sl], ctx.temperature)
            p_cV = logp_cV.exp()
            if need_q:
                grad_q_TV[sl] = logq_cV.exp().sub_(p_cV).mul_(g_c1)
            if need_p:
                d_cV = logp_cV.sub_(logq_cV).sub_(kl_T[sl].unsqueeze(-1)).mul_(p_cV).mul_(g_c1)
                grad_p_TV[sl] = d_cV
        return grad_p_TV, grad_q_TV, None, None, None


class _VocabParallelJSD(torch.autograd.Function):
    """forward: global (max, log S) of both, then sum_v p (log p - log M) and sum_v q (log q - log M)
    per shard, one SUM all-reduce; backward: no comm. Only 0 < beta < 1 (the limits are KLs)."""

    @staticmethod
    def forward(ctx, logits_p_TV, logits_q_TV, beta, group, temperature, chunk_size):
        T, V = logits_p_TV.shape
        chunks = token_chunks(T, V, chunk_size)
        maxp_loc_T, sump_loc_T = local_max_sumexp(logits_p_TV, temperature, chunks)
        maxq_loc_T, sumq_loc_T = local_max_sumexp(logits_q_TV, temperature, chunks)
        # One MAX and one SUM all-reduce for both distributions: stack p and q along a leading dim.
        max_2T, log_sumexp_2T, _ = global_max_log_sumexp(
            torch.stack([maxp_loc_T, maxq_loc_T]), torch.stack([sump_loc_T, sumq_loc_T]), temperature, group
        )
        log_a, log_b = math.log1p(-beta), math.log(beta)  # log(1 - beta), log beta
        kl_loc_2T = torch.empty(2, T, dtype=torch.float32, device=logits_p_TV.device)  # KL(p||M), KL(q||M)
        for sl in chunks:
            logp_cV, logq_cV, logm_cV = _jsd_chunk(
                logits_p_TV[sl], logits_q_TV[sl], max_2T[:, sl], log_sumexp_2T[:, sl], temperature, log_a, log_b
            )
            kl_loc_2T[0, sl] = (logp_cV - logm_cV).mul_(logp_cV.exp()).sum(dim=-1)
            kl_loc_2T[1, sl] = (logq_cV - logm_cV).mul_(logq_cV.exp()).sum(dim=-1)
        kl_2T = all_reduce_(kl_loc_2T, dist.ReduceOp.SUM, group)
        ctx.save_for_backward(logits_p_TV, logits_q_TV, max_2T, log_sumexp_2T, kl_2T)
        ctx.beta, ctx.temperature, ctx.chunks = beta, temperature, chunks
        return beta * kl_2T[1] + (1.0 - beta) * kl_2T[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_T):
        logits_p_TV, logits_q_TV, max_2T, log_sumexp_2T, kl_2T = ctx.saved_tensors
        beta, temperature = ctx.beta, ctx.temperature
        need_p, need_q = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_p_TV = torch.empty_like(logits_p_TV) if need_p else None
        grad_q_TV = torch.empty_like(logits_q_TV) if need_q else None
        g_T = grad_T.float() / temperature
        log_a, log_b = math.log1p(-beta), math.log(beta)
        for sl in ctx.chunks:
            g_c1 = g_T[sl].unsqueeze(-1)
            logp_cV, logq_cV, logm_cV = _jsd_chunk(
                logits_p_TV[sl], logits_q_TV[sl], max_2T[:, sl], log_sumexp_2T[:, sl], temperature, log_a, log_b
            )
            if need_p:
                d_cV = (logp_cV - logm_cV).sub_(kl_2T[0, sl].unsqueeze(-1)).mul_(logp_cV.exp())
                grad_p_TV[sl] = d_cV.mul_(g_c1 * (1.0 - beta))
            if need_q:
                d_cV = (logq_cV - logm_cV).sub_(kl_2T[1, sl].unsqueeze(-1)).mul_(logq_cV.exp())
                grad_q_TV[sl] = d_cV.mul_(g_c1 * beta)
        return grad_p_TV, grad_q_TV, None, None, None, None


def _jsd_chunk(rawp_cV, rawq_cV, max_2c, log_sumexp_2c, temperature, log_a, log_b):
    """Full-vocab log p, log q and log M = logaddexp(log(1-beta) + log p, log beta + log q), [c, V]."""
    logp_cV = log_softmax_chunk(rawp_cV, max_2c[0], log_sumexp_2c[0], temperature)
    logq_cV = log_softmax_chunk(rawq_cV, max_2c[1], log_sumexp_2c[1], temperature)
    return logp_cV, logq_cV, torch.logaddexp(logp_cV + log_a, logq_cV + log_b)


def vocab_parallel_kl(logits_p, logits_q, group=None, temperature=1.0, chunk_size=None, impl="auto"):
    """Per-token KL(p||q) = sum_v p_v (log p_v - log q_v) over the full vocabulary.

    logits_p, logits_q: [..., V] local shards of the same vocabulary layout (p: student, q: reference).
    Returns [...] float32. Differentiable w.r.t. both (pass q detached when it is frozen: its gradient
    is then neither computed nor stored).
    impl: "auto" (Triton kernels on CUDA, torch otherwise) | "triton" (_triton.py; chunk_size unused) | "torch".
    """
    temperature = check_temperature(temperature)
    if logits_p.shape != logits_q.shape:
        raise ValueError(
            f"logits_p {tuple(logits_p.shape)} and logits_q {tuple(logits_q.shape)} must have "
            f"the same shape (same tokens, same vocab shard)"
        )
    if resolve_impl(impl, logits_p) == "triton":
        from megaopd.ops import _triton

        _, kl_T, _ = _triton.PairOp.apply(
            flatten_tokens(logits_p, "logits_p"),
            None,
            flatten_tokens(logits_q, "logits_q"),
            group,
            temperature,
            False,
            False,
        )
        return kl_T.view(logits_p.shape[:-1])
    kl_T = _VocabParallelKL.apply(
        flatten_tokens(logits_p, "logits_p"), flatten_tokens(logits_q, "logits_q"), group, temperature, chunk_size
    )
    return kl_T.view(logits_p.shape[:-1])


def vocab_parallel_jsd(logits_student, logits_teacher, beta, group=None, temperature=1.0, chunk_size=None, impl="auto"):
    """Per-token generalized JSD(beta) of GKD over the full vocabulary (p = student, q = teacher):
    M = beta q + (1 - beta) p,  JSD = beta KL(q||M) + (1 - beta) KL(p||M).

    beta = 0 returns KL(q||p) (forward KL) and beta = 1 returns KL(p||q) (reverse KL), TRL's convention
    (see the module docstring). logits_*: [..., V] local shards. Returns [...] float32. Differentiable
    w.r.t. the student (and the teacher, if it is not detached).
    impl: "auto" (Triton kernels on CUDA, torch otherwise) | "triton" (_triton.py; chunk_size unused) | "torch".
    """
    temperature = check_temperature(temperature)
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"JSD beta must be in [0, 1], got {beta}")
    if logits_student.shape != logits_teacher.shape:
        raise ValueError(
            f"logits_student {tuple(logits_student.shape)} and logits_teacher "
            f"{tuple(logits_teacher.shape)} must have the same shape"
        )
    if beta == 0.0:
        return vocab_parallel_kl(logits_teacher, logits_student, group, temperature, chunk_size, impl)
    if beta == 1.0:
        return vocab_parallel_kl(logits_student, logits_teacher, group, temperature, chunk_size, impl)
    if resolve_impl(impl, logits_student) == "triton":
        from megaopd.ops import _triton

        return _triton.JSDOp.apply(
            flatten_tokens(logits_student, "logits_student"),
            flatten_tokens(logits_teacher, "logits_teacher"),
            beta,
            group,
            temperature,
        ).view(logits_student.shape[:-1])
    jsd_T = _VocabParallelJSD.apply(
        flatten_tokens(logits_student, "logits_student"),
        flatten_tokens(logits_teacher, "logits_teacher"),
        beta,
        group,
        temperature,
        chunk_size,
    )
    return jsd_T.view(logits_student.shape[:-1])
