"""Triton kernels of the vocab-parallel ops (the `impl="triton"` path): per-row math on one vocabulary shard,
no communication, no autograd. Imported only when that path runs (triton is optional on CPU).

Grid: (T, S): program (t, s) owns token t and the s-th of S contiguous column ranges ("splits") of the local
shard; S > 1 gives short sequences enough programs to fill a GPU. Rows may be strided (logits[:, :-1]
views): the column stride must be 1. Row offsets are int64 (T x V > 2^31 elements).

Loops run over `tl.range(start, end, BLOCK, num_stages=STAGES)`: STAGES > 1 has Triton prefetch the next
blocks into shared memory (cp.async) while the current one is reduced, so loads stay in flight through the
reductions; a plain `range` (STAGES = 1) issues a block's loads only when the previous block is done.

stats_kernel (forward): one read of the shard; per (split, token) it writes the partials, each relative to
the split's own running max m (raw units) and x = (raw - m) / temperature, updated online block by block:
    row 0 m_p    1 s_p = sum e^xp    2 sum e^xp xp    3 m_q    4 s_q = sum e^xq    5 sum e^xp (xp - xq)
When the running max moves by delta = (m_old - m_new) / temperature (<= 0) the sums rescale exactly as the
cross-rank combination does (_triton.combine): s <- e^delta s, sum e^x x <- e^delta (sum e^x x + delta s),
sum e^xp (xp - xq) <- e^delta_p (that + (delta_p - delta_q) s_p).

grad_kernel (backward): one read of the shard(s), one write of the gradient in the output's dtype (which may
be q's own memory: each element is read before the same program writes it). With the global max M and
log S per token, log p = (raw - M) / temperature - log S, and per-token coefficients (1/temperature included)
    MODE 0: dp = p (B log p + C) + D 1[v = id]                    (logsumexp, log-probs, entropy)
    MODE 1: dp = p (A (log p - log q) + C) + D 1[v = id];  dq = G (q - p)          (KL, fused)
    MODE 2: dp = A p (log p - log m - Kp);  dq = G q (log q - log m - Kq),
            log m = logaddexp(log(1 - beta) + log p, log beta + log q)            (JSD)
jsd_kernel: sum p (log p - log m) and sum q (log q - log m) per (split, token), for global M, log S.
"""

from __future__ import annotations

# (Kernels spell -inf as the literal float("-inf"): compiled Triton reads no module globals but constexprs,
# and the interpreter, which the CPU tests use, would not notice one.)
import triton
import triton.language as tl

STATS_ROWS = 6  # rows of stats_kernel's output (module docstring)
TOKEN_ROWS = 11  # rows of grad_kernel's per-token input: Mp, lSp, Mq, lSq, A, B, C, D, G, Kp, Kq


@triton.jit
def _rescale(m, m_new, inv_temp):
    """delta = (m - m_new) / temperature, 0 before the first block (m = -inf: every sum is still 0)."""
    return tl.where(m == float("-inf"), 0.0, (m - m_new) * inv_temp)


@triton.jit
def stats_kernel(
    p_ptr,
    q_ptr,
    out_ptr,
    T,
    V,
    stride_p,
    stride_q,
    split_size,
    inv_temp,
    HAS_Q: tl.constexpr,
    WITH_XEXP: tl.constexpr,
    WITH_DIFF: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    start = split * split_size
    end = tl.minimum(start + split_size, V)
    p_row = p_ptr + row.to(tl.int64) * stride_p
    q_row = q_ptr + row.to(tl.int64) * stride_q
    mp = float("-inf")
    sp = 0.0
    xe = 0.0
    mq = float("-inf")
    sq = 0.0
    dd = 0.0
    for off in tl.range(start, end, BLOCK, num_stages=STAGES):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < end
        rp = tl.load(p_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        mp_new = tl.maximum(mp, tl.max(rp, axis=0))
        dp = _rescale(mp, mp_new, inv_temp)
        ap = tl.exp(dp)
        xp = (rp - mp_new) * inv_temp
        ep = tl.where(mask, tl.exp(xp), 0.0)  # masked tail: x = -inf, so keep it out of every product
        if WITH_XEXP:
            xe = ap * (xe + dp * sp) + tl.sum(tl.where(mask, ep * xp, 0.0), axis=0)
        if HAS_Q:
            rq = tl.load(q_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            mq_new = tl.maximum(mq, tl.max(rq, axis=0))
            dq = _rescale(mq, mq_new, inv_temp)
            xq = (rq - mq_new) * inv_temp
            sq = tl.exp(dq) * sq + tl.sum(tl.where(mask, tl.exp(xq), 0.0), axis=0)
            if WITH_DIFF:
                dd = ap * (dd + (dp - dq) * sp) + tl.sum(tl.where(mask, ep * (xp - xq), 0.0), axis=0)
            mq = mq_new
        sp = ap * sp + tl.sum(ep, axis=0)
        mp = mp_new
    base = out_ptr + split * T + row
    step = nsplit * T
    tl.store(base, mp)
    tl.store(base + step, sp)
    tl.store(base + 2 * step, xe)
    tl.store(base + 3 * step, mq)
    tl.store(base + 4 * step, sq)
    tl.store(base + 5 * step, dd)


@triton.jit
def _log_softmax(raw, m, log_s, inv_temp):
    return (raw - m) * inv_temp - log_s


@triton.jit
def _logaddexp(a, b):
    hi = tl.maximum(a, b)
    return hi + tl.log(tl.exp(a - hi) + tl.exp(b - hi))


@triton.jit
def grad_kernel(
    p_ptr,
    q_ptr,
    gp_ptr,
    gq_ptr,
    tok_ptr,
    ids_ptr,
    T,
    V,
    stride_p,
    stride_q,
    stride_gp,
    stride_gq,
    split_size,
    inv_temp,
    log_a,
    log_b,
    MODE: tl.constexpr,
    WRITE_P: tl.constexpr,
    WRITE_Q: tl.constexpr,
    HAS_ONEHOT: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    start = split * split_size
    end = tl.minimum(start + split_size, V)
    row64 = row.to(tl.int64)
    p_row = p_ptr + row64 * stride_p
    q_row = q_ptr + row64 * stride_q
    gp_row = gp_ptr + row64 * stride_gp
    gq_row = gq_ptr + row64 * stride_gq
    tok = tok_ptr + row
    m_p = tl.load(tok)
    ls_p = tl.load(tok + T)
    m_q = tl.load(tok + 2 * T)
    ls_q = tl.load(tok + 3 * T)
    a = tl.load(tok + 4 * T)
    b = tl.load(tok + 5 * T)
    c = tl.load(tok + 6 * T)
    d = tl.load(tok + 7 * T)
    g = tl.load(tok + 8 * T)
    k_p = tl.load(tok + 9 * T)
    k_q = tl.load(tok + 10 * T)
    target = -1
    if HAS_ONEHOT:
        target = tl.load(ids_ptr + row)  # local id, -1 where another rank owns the token
    for off in tl.range(start, end, BLOCK, num_stages=STAGES):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < end
        logp = _log_softmax(tl.load(p_row + cols, mask=mask, other=0.0).to(tl.float32), m_p, ls_p, inv_temp)
        p = tl.exp(logp)
        if MODE == 0:
            gp = p * (b * logp + c)
        else:
            logq = _log_softmax(tl.load(q_row + cols, mask=mask, other=0.0).to(tl.float32), m_q, ls_q, inv_temp)
            if MODE == 1:
                gp = p * (a * (logp - logq) + c)
                gq = g * (tl.exp(logq) - p)
            else:
                logm = _logaddexp(log_a + logp, log_b + logq)
                gp = a * p * (logp - logm - k_p)
                gq = g * tl.exp(logq) * (logq - logm - k_q)
            if WRITE_Q:
                tl.store(gq_row + cols, gq.to(gq_ptr.dtype.element_ty), mask=mask)
        if HAS_ONEHOT:
            gp = tl.where(cols == target, gp + d, gp)
        if WRITE_P:
            tl.store(gp_row + cols, gp.to(gp_ptr.dtype.element_ty), mask=mask)


@triton.jit
def jsd_kernel(
    p_ptr,
    q_ptr,
    tok_ptr,
    out_ptr,
    T,
    V,
    stride_p,
    stride_q,
    split_size,
    inv_temp,
    log_a,
    log_b,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    start = split * split_size
    end = tl.minimum(start + split_size, V)
    row64 = row.to(tl.int64)
    p_row = p_ptr + row64 * stride_p
    q_row = q_ptr + row64 * stride_q
    m_p = tl.load(tok_ptr + row)
    ls_p = tl.load(tok_ptr + T + row)
    m_q = tl.load(tok_ptr + 2 * T + row)
    ls_q = tl.load(tok_ptr + 3 * T + row)
    kl_p = 0.0
    kl_q = 0.0
    for off in tl.range(start, end, BLOCK, num_stages=STAGES):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < end
        logp = _log_softmax(tl.load(p_row + cols, mask=mask, other=0.0).to(tl.float32), m_p, ls_p, inv_temp)
        logq = _log_softmax(tl.load(q_row + cols, mask=mask, other=0.0).to(tl.float32), m_q, ls_q, inv_temp)
        logm = _logaddexp(log_a + logp, log_b + logq)
        kl_p += tl.sum(tl.where(mask, tl.exp(logp) * (logp - logm), 0.0), axis=0)
        kl_q += tl.sum(tl.where(mask, tl.exp(logq) * (logq - logm), 0.0), axis=0)
    tl.store(out_ptr + split * T + row, kl_p)
    tl.store(out_ptr + (nsplit + split) * T + row, kl_q)
