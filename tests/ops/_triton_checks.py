"""Checks of megaopd.ops' Triton path, run inside a spawned worker whose environment has TRITON_INTERPRET=1.

Triton decides when it is first imported whether its kernels (and its own tl.* helpers) are interpreted, and
in the test process megatron-core has usually imported it already; a fresh process with the variable set is
the reliable way to interpret. Every function returns a list of mismatch messages (empty: all good).
"""

from __future__ import annotations

import math

import torch

from tests.ops import _cases

# (block, splits, dtype, logit scale, temperature): forced launch configurations at V=3000, 3 tokens
LAUNCH_CONFIGS = {
    "one_split": (1024, 1, "float32", 3.0, 1.0),  # 3 blocks per row, the last one a tail
    "splits_bf16_padded": (256, 5, "bfloat16", 5.0, 1.3),  # 4 splits of 3 blocks; the last is all padding
    "extreme": (128, 7, "float32", 1e4, 0.8),  # logits ~1e4, 6 splits of 4 blocks, tails
}


def run(rank, world_size, case_names, configs, interface=False):
    """{check name: errors}; case checks at this world size, the others only at TP=1."""
    import os

    from triton.runtime.interpreter import InterpretedFunction

    from megaopd.ops import _kernels

    if os.environ.get("TRITON_INTERPRET") != "1" or not isinstance(_kernels.stats_kernel, InterpretedFunction):
        raise RuntimeError("the Triton checks need TRITON_INTERPRET=1 in the worker's environment")
    import numpy as np
    import torch.distributed as dist

    np.seterr(invalid="ignore")  # the interpreter's numpy meets 0 * -inf in masked-off lanes (discarded)
    group = dist.new_group(ranks=list(range(world_size))) if world_size > 1 else None
    out = {}
    for case in _cases.CASES:
        if case.name in case_names:
            got = _cases.run_case(case, rank, world_size, group, impl="triton")
            out[f"case {case.name}"] = (
                [got] if world_size > 1 else _cases.compare(case, 1, [got], _cases.reference(case, 1))
            )
    for name in configs:
        out[f"launch {name}"] = check_launch_config(*LAUNCH_CONFIGS[name])
    if interface:
        out["overwrite_q and strided rows"] = check_overwrite_q_and_strided_rows()
    return out


def _reference(p, q, ids, w, tau, beta):
    """float64 values and gradients of: sum w_lp logprob + w_kl KL(p||q) (q frozen), entropy, KL(p||q) with
    both gradients, JSD(beta) with both gradients."""
    p, q = p.double().requires_grad_(), q.double().requires_grad_()
    lp, lq = torch.log_softmax(p / tau, -1), torch.log_softmax(q / tau, -1)
    kl = lambda a, b: (a.exp() * (a - b)).sum(-1)  # noqa: E731
    logprobs = lp.gather(-1, ids[:, None])[:, 0]
    log_m = torch.logaddexp(math.log(beta) + lq, math.log(1 - beta) + lp)
    values = {
        "fused": (logprobs * w[0]).sum() + (kl(lp, lq.detach()) * w[1]).sum(),
        "entropy": -(lp.exp() * lp).sum(-1),
        "kl": kl(lp, lq),
        "jsd": beta * kl(lq, log_m) + (1 - beta) * kl(lp, log_m),
    }
    out = {}
    for name, v in values.items():
        loss = v if v.dim() == 0 else (v * w[2]).sum()
        gp, gq = torch.autograd.grad(loss, [p, q], retain_graph=True, allow_unused=True)
        out[name] = (v.detach(), gp, gq)
    return out


def _triton_results(p, q, ids, w, tau, beta):
    from megaopd import ops

    out = {}
    pp = p.clone().requires_grad_()
    logprobs, kl, _ = ops.vocab_parallel_logprobs_kl(pp, ids, q, temperature=tau, impl="triton")
    loss = (logprobs.double() * w[0]).sum() + (kl.double() * w[1]).sum()
    out["fused"] = (loss.detach(), torch.autograd.grad(loss, pp)[0], None)
    for name, fn in (
        ("entropy", lambda a, b: ops.vocab_parallel_entropy(a, temperature=tau, impl="triton")),
        ("kl", lambda a, b: ops.vocab_parallel_kl(a, b, temperature=tau, impl="triton")),
        ("jsd", lambda a, b: ops.vocab_parallel_jsd(a, b, beta, temperature=tau, impl="triton")),
    ):
        pp, qq = p.clone().requires_grad_(), q.clone().requires_grad_()
        v = fn(pp, qq)
        grads = torch.autograd.grad((v.double() * w[2]).sum(), [pp, qq], allow_unused=True)
        out[name] = (v.detach(), *grads)
    return out


def check_launch_config(block, splits, dtype, scale, tau) -> list[str]:
    from megaopd.ops import _triton

    _triton.FORCE_LAUNCH = (block, splits, 4, 1)  # warps and stages: the interpreter ignores both
    try:
        T, V, pad, beta = 3, 3000, 800 if dtype == "bfloat16" else 0, 0.4
        g = torch.Generator().manual_seed(block)
        p, q = (scale * torch.randn(2, T, V, generator=g, dtype=torch.float64)).to(getattr(torch, dtype))
        if pad:
            p[:, V - pad :] = q[:, V - pad :] = _cases.PAD_LOGIT
        ids = torch.randint(0, V - pad, (T,), generator=g)
        w = torch.randn(3, T, generator=g, dtype=torch.float64)
        ref = _reference(p, q, ids, w, tau, beta)
        got = _triton_results(p, q, ids, w, tau, beta)
    finally:
        _triton.FORCE_LAUNCH = None
    real = slice(0, V - pad)
    spread = max(float((x[:, real].double().amax(-1) - x[:, real].double().amin(-1)).max()) for x in (p, q))
    atol = 1e-7 + 2.0**-23 * spread / tau * float(w.abs().max()) * 4
    rtol_g = 1e-2 if dtype == "bfloat16" else 4e-6
    errors = []
    for name, (rv, rgp, rgq) in ref.items():
        gv, ggp, ggq = got[name]
        err = (gv.double() - rv).abs().max().item()
        if not err <= atol + 4e-6 * rv.abs().max().item():
            errors.append(f"{name} value: max err {err:.3g}")
        for which, gg, rg in (("grad_p", ggp, rgp), ("grad_q", ggq, rgq)):
            if rg is None or gg is None and name == "fused":
                continue
            err = (gg.double() - rg).abs().max().item()
            if gg.dtype != p.dtype or not err <= atol + rtol_g * rg.abs().max().item():
                errors.append(f"{name} {which}: {gg.dtype}, max err {err:.3g} (ref max {rg.abs().max().item():.3g})")
    return errors


def check_overwrite_q_and_strided_rows() -> list[str]:
    """Strided rows (megatron's [s, b, V] logits, one sequence: row stride b*V) are read in place, and give
    what contiguous logits give; under overwrite_q the fused backward writes into q's memory, in its dtype."""
    from megaopd import ops

    g = torch.Generator().manual_seed(3)
    full = (3 * torch.randn(5, 2, 40, generator=g)).to(torch.bfloat16).requires_grad_()
    q = (3 * torch.randn(5, 40, generator=g)).to(torch.bfloat16)
    ids = torch.randint(0, 40, (5,), generator=g)
    strided = full[:, 0]
    lp, kl, _ = ops.vocab_parallel_logprobs_kl(strided, ids, q, impl="triton")
    (grad_full,) = torch.autograd.grad((lp + kl).sum(), full)
    dense = full[:, 0].detach().contiguous().requires_grad_()
    q_copy = q.clone()
    lp2, kl2, _ = ops.vocab_parallel_logprobs_kl(dense, ids, q_copy, overwrite_q=True, impl="triton")
    (grad_dense,) = torch.autograd.grad((lp2 + kl2).sum(), dense)
    errors = []
    if strided.stride() != (80, 1):
        errors.append(f"test setup: stride {strided.stride()}")
    if not (torch.equal(lp, lp2) and torch.equal(kl, kl2)):
        errors.append("strided and contiguous logits give different values")
    if not torch.equal(grad_full[:, 0], grad_dense) or grad_full[:, 1].any():
        errors.append("strided and contiguous logits give different gradients")
    if grad_dense.data_ptr() != q_copy.data_ptr() or grad_dense.dtype != torch.bfloat16:
        errors.append("overwrite_q: the gradient is not in q's memory / dtype")
    return errors


def compile_for_gpu(arch: int = 90, dtype: str = "bf16") -> list[str]:
    """Compile every kernel specialization the ops launch for an NVIDIA GPU of compute capability `arch`
    (down to the cubin, with the ptxas triton ships), which needs no GPU: the compiled language is stricter
    than the interpreter (module globals, loop-carried types), so this catches what the CPU runs cannot.
    The specialization is the default launch's at T=4096, V=152064 (block 4096, 16 warps; megaopd.ops._gpu_build:
    16-byte vector loads), and the loops compile with and without prefetching (STAGES 1 and 3: the latter through
    cp.async, which the interpreter never runs)."""
    from megaopd.ops import _kernels as K
    from megaopd.ops._gpu_build import build

    errors = []
    specs = [
        (K.stats_kernel, dict(HAS_Q=q, WITH_XEXP=x, WITH_DIFF=q, BLOCK=4096))
        for q, x in ((False, False), (False, True), (True, False), (True, True))
    ]
    specs += [
        (K.grad_kernel, dict(MODE=m, WRITE_P=True, WRITE_Q=q, HAS_ONEHOT=m < 2, BLOCK=4096))
        for m, q in ((0, False), (1, False), (1, True), (2, True))
    ]
    specs += [(K.jsd_kernel, dict(BLOCK=4096))]
    for fn, consts in specs:
        for stages in (1, 3):
            c = dict(consts, STAGES=stages)
            try:
                kernel = build(fn, c, warps=16, arch=arch, dtype=dtype)
            except Exception as e:  # noqa: BLE001 - reported as a mismatch message
                errors.append(f"{fn.fn.__name__} {c}: {type(e).__name__}: {str(e)[:500]}")
                continue
            ptx = kernel.asm["ptx"]
            if "ld.global.v4" not in ptx and "cp.async" not in ptx:
                errors.append(f"{fn.fn.__name__} {c}: no 16-byte loads in the PTX")
            if (stages > 1) != ("cp.async" in ptx):
                state = "absent" if stages > 1 else "used"
                errors.append(f"{fn.fn.__name__} {c}: STAGES={stages} but cp.async {state}")
    return errors
