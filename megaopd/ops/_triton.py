"""The `impl="triton"` path of the vocab-parallel ops: autograd Functions over the kernels of _kernels.py.

Same formulas and outputs as the torch path (the docstrings of logprobs.py, divergence.py, fused.py), computed
differently: per vocabulary shard one kernel reads the logits once and writes per-token partials relative to
each split's own max (_kernels.stats_kernel); the partials of all splits of all TP ranks are combined by ONE
all-gather of [6 S + 1, T] floats per rank (the +1: the sampled token's raw logit, from its owner rank) and
the same arithmetic on every rank, so all ranks get bitwise the same results:
    M = max_i m_i,  shift_i = (m_i - M) / temperature,  S = sum_i e^shift_i s_i,
    sum e^x x      = sum_i e^shift_i (xe_i + shift_i s_i),
    sum e^xp (xp - xq) = sum_i e^shift_p_i (d_i + (shift_p_i - shift_q_i) s_p_i)   (x against the global max)
The backward needs no communication: one kernel reads the logits once more and writes the gradient in the
logits' dtype (no float32 [T, V] buffer at all). Bytes moved per logit: forward 1 read, backward 1 read and 1
write (the KL ops read q too). JSD needs log m = log(beta q + (1 - beta) p), hence the global normalizers
first: it reads p and q twice in the forward and adds one SUM all-reduce of [2, T].

chunk_size does not apply (no [chunk, V] buffers exist here). On CPU tensors this runs only under Triton's
interpreter (TRITON_INTERPRET=1), which is how the tests run it.
Tensor-name legend: megaopd/ops/_common.py.   Tests: pytest tests/ops -k triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
from torch.autograd.function import once_differentiable

from megaopd.ops import _kernels as K
from megaopd.ops._common import all_gather, all_reduce_, owned_local_ids

# (block, splits, warps, stages): tests set it to exercise block tails and several splits at small V; the launch
# sweep of benchmarks/loss.py (--sweep, on a GPU) sets it to time each configuration.
FORCE_LAUNCH: tuple[int, int, int, int] | None = None
MAX_BLOCK = 4096


@dataclass(frozen=True)
class Launch:
    """How a kernel runs over [T, V]: grid (T, splits), `block` columns per loop step, `split_size` columns per
    split (whole blocks), `warps` per program, and `stages` of its loop's loads in flight (1: no prefetch)."""

    block: int
    splits: int
    split_size: int
    warps: int
    stages: int


def launch_config(T: int, V: int, device: torch.device) -> Launch:
    """The launch of every kernel of one op over [T, V].

    GPU: enough programs to fill the machine (about 8 per SM) even for short sequences, but splits of at
    least 4 blocks so each program streams a while; ~8 columns per thread per loaded tensor at the largest
    block; no prefetch (unmeasured: benchmarks/loss.py --sweep times the alternatives on a GPU).
    Interpreter (CPU): one split, blocks of <= 1024.
    """
    if FORCE_LAUNCH is not None:
        block, splits, warps, stages = FORCE_LAUNCH
    elif device.type == "cuda":
        block = min(MAX_BLOCK, triton.next_power_of_2(V))
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        splits = max(1, min(triton.cdiv(8 * sms, max(T, 1)), triton.cdiv(V, 4 * block)))
        warps, stages = max(4, min(16, block // 256)), 1
    else:
        block, splits, warps, stages = min(1024, triton.next_power_of_2(V)), 1, 4, 1
    split_size = triton.cdiv(triton.cdiv(V, splits), block) * block  # whole blocks per split
    return Launch(block, triton.cdiv(V, split_size), split_size, warps, stages)


def _prepare(x_TV: torch.Tensor) -> torch.Tensor:
    """The kernels need unit column stride; any row stride is fine (no copy for logits[:, :-1] views)."""
    return x_TV if x_TV.stride(1) == 1 else x_TV.contiguous()


def _stats(p_TV, q_TV, temperature, with_xexp, with_diff):
    """Partials [6, S, T] of the local shard (see _kernels.stats_kernel) and the launch config."""
    T, V = p_TV.shape
    L = launch_config(T, V, p_TV.device)
    out = torch.zeros(K.STATS_ROWS, L.splits, T, dtype=torch.float32, device=p_TV.device)
    if T:
        q = q_TV if q_TV is not None else p_TV
        K.stats_kernel[(T, L.splits)](
            p_TV,
            q,
            out,
            T,
            V,
            p_TV.stride(0),
            q.stride(0),
            L.split_size,
            1.0 / temperature,
            HAS_Q=q_TV is not None,
            WITH_XEXP=with_xexp,
            WITH_DIFF=with_diff,
            BLOCK=L.block,
            STAGES=L.stages,
            num_warps=L.warps,
        )
    return out


def _gathered_stats(partials_6ST, target_T, group):
    """ONE all-gather of every rank's partials (+ the target logit row) -> ([6, R*S, T], target sum [T]).

    Rank-major then split order is global vocabulary order; every rank then combines the same numbers.
    """
    n, S, T = partials_6ST.shape
    extra = target_T if target_T is not None else torch.zeros(0, T, device=partials_6ST.device)
    flat = torch.cat([partials_6ST.reshape(n * S, T), extra.reshape(-1, T)])
    parts = all_gather(flat, group)  # R x [6 S (+1), T]
    stats_6NT = torch.stack([x[: n * S].view(n, S, T) for x in parts], dim=1).reshape(n, len(parts) * S, T)
    target = sum(x[n * S] for x in parts) if target_T is not None else None
    return stats_6NT, target


def combine(stats_6NT, temperature):
    """Global (Mp, log Sp, Mq, log Sq, sum p xp, sum p (xp - xq)) per token from the partials of all
    splits and ranks; the last two are expectations under p of x = z - M/temperature (module docstring)."""
    m_p, s_p, xe, m_q, s_q, d = stats_6NT.unbind(0)
    big_p, big_q = m_p.amax(0), m_q.amax(0)
    shift_p, shift_q = (m_p - big_p) / temperature, (m_q - big_q) / temperature
    scale_p = shift_p.exp()
    sum_p = (scale_p * s_p).sum(0)
    sum_q = (shift_q.exp() * s_q).sum(0)
    e_x = (scale_p * (xe + shift_p * s_p)).sum(0) / sum_p
    e_diff = (scale_p * (d + (shift_p - shift_q) * s_p)).sum(0) / sum_p
    return big_p, sum_p.log(), big_q, sum_q.log(), e_x, e_diff


def _owned_target(logits_TV, ids_T, group):
    """(the raw logit at ids on its owner rank, 0 elsewhere, as float32 [T]; local ids, -1 if not owned)."""
    owned_T, local_T = owned_local_ids(ids_T, logits_TV.shape[1], group)
    target_T = logits_TV.gather(1, local_T.unsqueeze(1)).squeeze(1).float().masked_fill_(~owned_T, 0.0)
    return target_T, torch.where(owned_T, local_T, torch.full_like(local_T, -1))


def _grad(mode, p_TV, q_TV, tok_nT, ids_T, temperature, write_p, write_q, out_p=None, log_ab=(0.0, 0.0)):
    """Launch grad_kernel; returns (grad_p or None, grad_q or None) in the logits' dtypes."""
    T, V = p_TV.shape
    L = launch_config(T, V, p_TV.device)
    gp = (
        (out_p if out_p is not None else torch.empty(p_TV.shape, dtype=p_TV.dtype, device=p_TV.device))
        if write_p
        else None
    )
    gq = torch.empty(q_TV.shape, dtype=q_TV.dtype, device=q_TV.device) if write_q else None
    q = q_TV if q_TV is not None else p_TV
    tok = torch.zeros(K.TOKEN_ROWS, T, dtype=torch.float32, device=p_TV.device)
    tok[: tok_nT.shape[0]] = tok_nT
    if T:
        dummy_p, dummy_q = gp if gp is not None else p_TV, gq if gq is not None else q
        K.grad_kernel[(T, L.splits)](
            p_TV,
            q,
            dummy_p,
            dummy_q,
            tok,
            ids_T if ids_T is not None else tok,
            T,
            V,
            p_TV.stride(0),
            q.stride(0),
            dummy_p.stride(0),
            dummy_q.stride(0),
            L.split_size,
            1.0 / temperature,
            log_ab[0],
            log_ab[1],
            MODE=mode,
            WRITE_P=write_p,
            WRITE_Q=write_q,
            HAS_ONEHOT=ids_T is not None,
            BLOCK=L.block,
            STAGES=L.stages,
            num_warps=L.warps,
        )
    return gp, gq


def _token_rows(m_p, ls_p, m_q=None, ls_q=None, a=None, b=None, c=None, d=None, g=None, k_p=None, k_q=None):
    """The [11, T] per-token input of grad_kernel (absent rows are 0)."""
    rows = [m_p, ls_p, m_q, ls_q, a, b, c, d, g, k_p, k_q]
    zero = torch.zeros_like(m_p)
    return torch.stack([zero if r is None else r.float() for r in rows])


class SoftmaxOp(torch.autograd.Function):
    """kind = "logsumexp" | "logprobs" | "entropy" of p = softmax(logits / temperature).
    forward: stats kernel + one all-gather; backward: grad_kernel MODE 0, no comm."""

    @staticmethod
    def forward(ctx, logits_TV, ids_T, group, temperature, kind):
        logits_TV = _prepare(logits_TV)
        partials = _stats(logits_TV, None, temperature, with_xexp=kind == "entropy", with_diff=False)
        target_T, local_T = _owned_target(logits_TV, ids_T, group) if kind == "logprobs" else (None, None)
        stats, target = _gathered_stats(partials, target_T, group)
        m_p, ls_p, _, _, e_x, _ = combine(stats, temperature)
        if kind == "logsumexp":
            out = m_p / temperature + ls_p
        elif kind == "logprobs":
            out = (target - m_p) / temperature - ls_p
        else:
            out = ls_p - e_x  # H = log S - E_p[x]
        ctx.save_for_backward(logits_TV, local_T, m_p, ls_p, out)
        ctx.temperature, ctx.kind = temperature, kind
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_T):
        logits_TV, local_T, m_p, ls_p, out = ctx.saved_tensors
        g = grad_T.float() / ctx.temperature
        if ctx.kind == "logsumexp":  # g p
            rows = _token_rows(m_p, ls_p, c=g)
        elif ctx.kind == "logprobs":  # g (1[v = id] - p)
            rows = _token_rows(m_p, ls_p, c=-g, d=g)
        else:  # -g p (log p + H)
            rows = _token_rows(m_p, ls_p, b=-g, c=-g * out)
        grad, _ = _grad(0, logits_TV, None, rows, local_T, ctx.temperature, True, False)
        return grad, None, None, None, None


class PairOp(torch.autograd.Function):
    """(logprobs at ids or None, KL(p||q), entropy or None) from one stats pass over p and q.
    forward: stats kernel + one all-gather; backward: grad_kernel MODE 1 writing dL/dp (into q's memory when
    overwrite_q) and, when q requires grad, dL/dq = g (q - p) in the same pass. No comm."""

    @staticmethod
    def forward(ctx, p_TV, ids_T, q_TV, group, temperature, with_entropy, overwrite_q):
        p_TV, q_TV = _prepare(p_TV), _prepare(q_TV)
        partials = _stats(p_TV, q_TV, temperature, with_xexp=with_entropy, with_diff=True)
        target_T, local_T = _owned_target(p_TV, ids_T, group) if ids_T is not None else (None, None)
        stats, target = _gathered_stats(partials, target_T, group)
        m_p, ls_p, m_q, ls_q, e_x, e_diff = combine(stats, temperature)
        # KL = E_p[(zp - Mp/tau) - (zq - Mq/tau)] - log Sp + log Sq: the maxima cancel (fused.py's formula)
        kl = e_diff - ls_p + ls_q
        logprobs = (target - m_p) / temperature - ls_p if target is not None else None
        entropy = ls_p - e_x if with_entropy else None
        ctx.save_for_backward(p_TV, q_TV, local_T, m_p, ls_p, m_q, ls_q, kl)
        ctx.temperature, ctx.overwrite_q = temperature, overwrite_q
        ctx.set_materialize_grads(False)
        if with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, kl, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs, grad_kl, _grad_entropy):
        p_TV, q_TV, local_T, m_p, ls_p, m_q, ls_q, kl = ctx.saved_tensors
        tau = ctx.temperature
        need_p, need_q = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        zero = torch.zeros_like(kl)
        a = grad_kl.float() / tau if grad_kl is not None else zero  # dp = p (a (log p - log q) - a KL - b) + b 1[id]
        b = grad_logprobs.float() / tau if grad_logprobs is not None else zero
        rows = _token_rows(m_p, ls_p, m_q, ls_q, a=a, c=-(a * kl + b), d=b, g=a)
        reuse = (
            ctx.overwrite_q
            and not need_q
            and q_TV.dtype == p_TV.dtype
            and q_TV.is_contiguous()
            and p_TV.shape == q_TV.shape
        )
        gp, gq = _grad(
            1,
            p_TV,
            q_TV,
            rows,
            local_T if grad_logprobs is not None else None,
            tau,
            need_p,
            need_q and grad_kl is not None,
            out_p=q_TV if reuse else None,
        )
        if need_q and gq is None:
            gq = torch.zeros_like(q_TV)
        return gp, None, gq, None, None, None, None


class JSDOp(torch.autograd.Function):
    """Generalized JSD(beta), 0 < beta < 1. forward: stats pass, one all-gather, then jsd_kernel (second read)
    and one SUM all-reduce of [2, T]; backward: grad_kernel MODE 2, both gradients in one pass, no comm."""

    @staticmethod
    def forward(ctx, p_TV, q_TV, beta, group, temperature):
        p_TV, q_TV = _prepare(p_TV), _prepare(q_TV)
        stats, _ = _gathered_stats(_stats(p_TV, q_TV, temperature, False, False), None, group)
        m_p, ls_p, m_q, ls_q, _, _ = combine(stats, temperature)
        T, V = p_TV.shape
        L = launch_config(T, V, p_TV.device)
        log_ab = (math.log1p(-beta), math.log(beta))
        tok = torch.stack([m_p, ls_p, m_q, ls_q])
        out = torch.zeros(2, L.splits, T, dtype=torch.float32, device=p_TV.device)
        if T:
            K.jsd_kernel[(T, L.splits)](
                p_TV,
                q_TV,
                tok,
                out,
                T,
                V,
                p_TV.stride(0),
                q_TV.stride(0),
                L.split_size,
                1.0 / temperature,
                log_ab[0],
                log_ab[1],
                BLOCK=L.block,
                STAGES=L.stages,
                num_warps=L.warps,
            )
        kl_2T = all_reduce_(out.sum(1), dist.ReduceOp.SUM, group)  # KL(p||m), KL(q||m)
        ctx.save_for_backward(p_TV, q_TV, m_p, ls_p, m_q, ls_q, kl_2T)
        ctx.beta, ctx.temperature, ctx.log_ab = beta, temperature, log_ab
        return beta * kl_2T[1] + (1.0 - beta) * kl_2T[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_T):
        p_TV, q_TV, m_p, ls_p, m_q, ls_q, kl_2T = ctx.saved_tensors
        g = grad_T.float() / ctx.temperature
        rows = _token_rows(m_p, ls_p, m_q, ls_q, a=g * (1.0 - ctx.beta), g=g * ctx.beta, k_p=kl_2T[0], k_q=kl_2T[1])
        gp, gq = _grad(
            2,
            p_TV,
            q_TV,
            rows,
            None,
            ctx.temperature,
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            log_ab=ctx.log_ab,
        )
        return gp, gq, None, None, None


def local_max_sumexp(logits_TV, temperature):
    """The shard's per-token (max, sum exp((raw - max) / temperature)) from the stats kernel (top-k's lse)."""
    stats = _stats(_prepare(logits_TV), None, temperature, False, False)
    m, s = stats[0], stats[1]
    big = m.amax(0)
    return big, (((m - big) / temperature).exp() * s).sum(0)
