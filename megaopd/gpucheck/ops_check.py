"""Part a: megaopd.ops and megaopd.losses on the device, in bfloat16 and float32, against float64 CPU references
(values and gradients) at the real vocabulary.

Ops: both implementations where they can run (the torch path, and the Triton kernels on CUDA: rows tagged
[torch] / [triton]), plus the Triton fused op on T x V > 2^31 logits (int64 offsets). The float64 formulas are
written here (plain torch on the full vocabulary; they never call megaopd.ops).
Losses: tests/losses/_reference.py (the suite's float64 references, importable from the repository root) on
its deterministic batches, with the vocabulary raised to the check's. Inputs are rounded to the dtype under
test first and the reference computed from the rounded values, so a row measures the code's arithmetic, not
the rounding of its inputs.

Bounds (max |got - ref| / max |ref| over the tensor): float32 1e-4 (values and gradients); bfloat16 values
2e-4 (the ops compute in float32 and return float32 whatever the input dtype), bfloat16 gradients 1e-2 (they
come back in the logits' dtype: 2^-9 relative rounding of each entry). Loss batches with logits ~ 700 +- 170
("large") get 10x: float32 itself is good to ~5e-5 there. A wrong formula is off by O(1).
"""

from __future__ import annotations

import contextlib
import math

import torch

from megaopd.gpucheck.report import Table, max_rel

BOUND = {"float32": (1e-4, 1e-4), "bfloat16": (2e-4, 1e-2)}  # (values, gradients)
TOPK = 16
SUPPORT_K = 8
JSD_BETA = 0.5


def _cases(quick: bool):
    """(label, scale, offset, temperature, chunk_size) of the op inputs."""
    return [("std", 3.0, 0.0, 1.0, 16), ("hot", 4.0, 100.0, 0.8, None)]


def _inputs(T: int, V: int, scale: float, offset: float, dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    inp = {
        "p": (offset + scale * r(T, V)).to(dtype),
        "q": (offset + scale * r(T, V)).to(dtype),
        "ids": torch.randint(0, V, (T,), generator=g),
        "gather_ids": torch.randint(0, V, (T, 3), generator=g),
    }
    inp["support_ids"] = torch.stack([torch.randperm(V, generator=g)[:SUPPORT_K] for _ in range(T)])
    inp["support_ref"] = torch.log_softmax(2 * r(T, SUPPORT_K), -1).float()
    inp["w"] = {k: r(T) for k in ("logprobs", "logsumexp", "entropy", "kl", "jsd", "gather", "support_kl", "fused_kl")}
    return inp


def _reference(inp: dict, tau: float) -> dict:
    """{name: (value, grad_p or None, grad_q or None)} in float64 from the formulas."""
    out = {}

    def run(name, fn, wrt_q=False):
        p = inp["p"].double().requires_grad_()
        q = inp["q"].double().requires_grad_()
        value = fn(p, q)
        loss = (value * inp["w"][name]).sum() if value.dim() == 1 else value
        gp, gq = torch.autograd.grad(loss, [p, q], allow_unused=True)
        out[name] = (value.detach(), gp, gq if wrt_q else None)

    ls = lambda x: torch.log_softmax(x / tau, -1)  # noqa: E731
    kl = lambda la, lb: (la.exp() * (la - lb)).sum(-1)  # noqa: E731
    run("logprobs", lambda p, q: ls(p).gather(-1, inp["ids"][:, None])[:, 0])
    run("logsumexp", lambda p, q: torch.logsumexp(p / tau, -1))
    run("entropy", lambda p, q: -(ls(p).exp() * ls(p)).sum(-1))
    run("kl", lambda p, q: kl(ls(p), ls(q)), wrt_q=True)

    def jsd(p, q):
        lp, lq = ls(p), ls(q)
        lm = torch.logaddexp(math.log(JSD_BETA) + lq, math.log(1 - JSD_BETA) + lp)
        return JSD_BETA * kl(lq, lm) + (1 - JSD_BETA) * kl(lp, lm)

    run("jsd", jsd, wrt_q=True)
    run("gather", lambda p, q: p.gather(-1, inp["gather_ids"]).sum(-1))

    def support_kl(p, q):
        lp = ls(p).gather(-1, inp["support_ids"])
        lph = lp - torch.logsumexp(lp, -1, keepdim=True)
        ref = inp["support_ref"].double()
        lqh = ref - torch.logsumexp(ref, -1, keepdim=True)
        return (lph.exp() * (lph - lqh)).sum(-1)

    run("support_kl", support_kl)

    def fused(p, q):  # weighted log-probs + KL(p || q), q frozen: the loss whose gradient is compared
        lp, lq = ls(p), ls(q.detach())
        return (lp.gather(-1, inp["ids"][:, None])[:, 0] * inp["w"]["logprobs"]).sum() + (
            kl(lp, lq) * inp["w"]["fused_kl"]
        ).sum()

    run("fused", fused)
    with torch.no_grad():
        lp = ls(inp["p"].double())
        out["topk_logp"] = lp
        out["topk"] = lp.topk(TOPK, dim=-1).values
        out["fused_values"] = (
            lp.gather(-1, inp["ids"][:, None])[:, 0],
            kl(lp, ls(inp["q"].double())),
            -(lp.exp() * lp).sum(-1),
        )
    return out


def _device_results(inp: dict, tau: float, chunk, device, group=None, rank=0, world=1, impl="auto") -> dict:
    """The ops on this rank's vocabulary shard (all of it at world 1): {name: (value, grad_p, grad_q)}.
    impl: the ops' implementation ("auto": Triton kernels on CUDA, the torch path elsewhere)."""
    from megaopd import ops

    V = inp["p"].shape[-1]
    v = V // world
    sl = slice(rank * v, (rank + 1) * v)
    kw = dict(group=group, temperature=tau, impl=impl)
    ckw = dict(kw, chunk_size=chunk)
    ids, gids = inp["ids"].to(device), inp["gather_ids"].to(device)
    out = {}

    def leaves():
        return (inp["p"][:, sl].to(device).requires_grad_(), inp["q"][:, sl].to(device).requires_grad_())

    def record(name, value, p, q=None):
        w = inp["w"][name if name in inp["w"] else "logprobs"].to(device)
        loss = (value.double() * w).sum() if value.dim() == 1 else value
        grads = torch.autograd.grad(loss, [p] if q is None else [p, q])
        out[name] = (
            value.detach().double().cpu() if value.dim() == 1 else value.detach(),
            grads[0].double().cpu(),
            grads[1].double().cpu() if q is not None else None,
        )

    p, q = leaves()
    record("logprobs", ops.vocab_parallel_logprobs(p, ids, **ckw), p)
    p, q = leaves()
    record("logsumexp", ops.vocab_parallel_logsumexp(p, **ckw), p)
    p, q = leaves()
    record("entropy", ops.vocab_parallel_entropy(p, **ckw), p)
    p, q = leaves()
    record("kl", ops.vocab_parallel_kl(p, q, **ckw), p, q)
    p, q = leaves()
    record("jsd", ops.vocab_parallel_jsd(p, q, JSD_BETA, **ckw), p, q)
    p, q = leaves()
    record("gather", ops.vocab_parallel_gather(p, gids, group=group, impl=impl).sum(-1), p)
    p, q = leaves()
    record(
        "support_kl",
        ops.vocab_parallel_support_kl(p, inp["support_ids"].to(device), inp["support_ref"].to(device), **kw),
        p,
    )
    p, q = leaves()
    lp, kl, ent = ops.vocab_parallel_logprobs_kl(p, ids, q.detach(), with_entropy=True, **ckw)
    loss = (lp.double() * inp["w"]["logprobs"].to(device)).sum() + (kl.double() * inp["w"]["fused_kl"].to(device)).sum()
    (gp,) = torch.autograd.grad(loss, [p])
    out["fused"] = (loss.detach().double().cpu(), gp.double().cpu(), None)
    out["fused_values"] = tuple(t.detach().double().cpu() for t in (lp, kl, ent))
    with torch.no_grad():
        vals, tids = ops.vocab_parallel_topk(inp["p"][:, sl].to(device), TOPK, **ckw)
    out["topk"] = (vals.double().cpu(), tids.cpu())
    return out


def _impls(device) -> tuple[str, ...]:
    """Both implementations where the Triton kernels can run (CUDA with triton), else the torch path."""
    from megaopd.ops._common import triton_available

    return ("torch", "triton") if device.type == "cuda" and triton_available() else ("torch",)


def check_ops(table: Table, device, dtypes, vocab: int, tokens: int) -> None:
    impls = _impls(device)
    if "triton" not in impls:
        table.skip(
            "a",
            "ops [triton]",
            f"the Triton kernels run on CUDA with triton installed, not on {device.type} "
            f"(tests/ops/test_triton.py runs them through Triton's interpreter)",
        )
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        vb, gb = BOUND[dtype_name]
        for i, (label, scale, offset, tau, chunk) in enumerate(_cases(False)):
            inp = _inputs(tokens, vocab, scale, offset, dtype, seed=10 + i)
            ref = _reference(inp, tau)
            for impl in impls:
                with table.guard("a", f"ops {label} [{impl}]", dtype_name):
                    _check_ops_impl(
                        table, dtype_name, label, ref, _device_results(inp, tau, chunk, device, impl=impl), impl, vb, gb
                    )
        if "triton" in impls and dtype_name == "bfloat16":
            with table.guard("a", "ops int64 offsets [triton]", dtype_name):
                check_int64_offsets(table, device, vocab, dtype)


def _check_ops_impl(table, dtype_name, label, ref, got, impl, vb, gb) -> None:
    big = 10 if label == "hot" else 1
    tag = f"{label} [{impl}]"
    for name in ("logprobs", "logsumexp", "entropy", "kl", "jsd", "gather", "support_kl"):
        rv, rgp, rgq = ref[name]
        gv, ggp, ggq = got[name]
        table.le("a", f"ops.{name} {tag}", dtype_name, "value rel", max_rel(gv, rv), vb * big)
        table.le("a", f"ops.{name} {tag}", dtype_name, "grad_p rel", max_rel(ggp, rgp), gb * big)
        if rgq is not None:
            table.le("a", f"ops.{name} {tag}", dtype_name, "grad_q rel", max_rel(ggq, rgq), gb * big)
    for what, g, r in zip(("logprobs", "kl", "entropy"), got["fused_values"], ref["fused_values"]):
        table.le("a", f"ops.logprobs_kl {tag}", dtype_name, f"{what} rel", max_rel(g, r), vb * big)
    table.le(
        "a", f"ops.logprobs_kl {tag}", dtype_name, "grad_p rel", max_rel(got["fused"][1], ref["fused"][1]), gb * big
    )
    vals, tids = got["topk"]
    table.le("a", f"ops.topk k={TOPK} {tag}", dtype_name, "values rel", max_rel(vals, ref["topk"]), vb * big)
    # Ties (frequent in bf16) may pick other ids of equal log-prob: check the ids' own log-probs.
    at_ids = ref["topk_logp"].gather(-1, tids.long())
    table.le("a", f"ops.topk k={TOPK} {tag}", dtype_name, "logp at ids rel", max_rel(vals, at_ids), vb * big)


def check_int64_offsets(table: Table, device, vocab: int, dtype, last: int = 4, elements: int = 2**31) -> None:
    """The fused op on T x V > 2^31 (`elements`) logits, element offsets past int32: its last rows, which only
    int64 offsets reach, against the float64 formulas on those rows (every quantity is per token)."""
    from megaopd import ops

    T = elements // vocab + last
    g = torch.Generator(device=device).manual_seed(7)
    p = (3 * torch.randn(T, vocab, generator=g, device=device)).to(dtype).requires_grad_()
    q = (3 * torch.randn(T, vocab, generator=g, device=device)).to(dtype)
    ids = torch.randint(0, vocab, (T,), generator=g, device=device)
    lp, kl, ent = ops.vocab_parallel_logprobs_kl(p, ids, q, with_entropy=True, impl="triton")
    (lp.sum() + kl.sum()).backward()
    rows = slice(T - last, T)
    p64, q64 = p.detach()[rows].double().cpu().requires_grad_(), q[rows].double().cpu()
    lp64, lq64 = torch.log_softmax(p64, -1), torch.log_softmax(q64, -1)
    ref_lp = lp64.gather(-1, ids[rows].cpu()[:, None])[:, 0]
    ref_kl = (lp64.exp() * (lp64 - lq64)).sum(-1)
    (ref_grad,) = torch.autograd.grad(ref_lp.sum() + ref_kl.sum(), p64)
    check = f"ops.logprobs_kl T={T} V={vocab} (T*V > {elements}) [triton]"
    vb, gb = BOUND[str(dtype).removeprefix("torch.")]
    dtype_name = str(dtype).removeprefix("torch.")
    table.le("a", check, dtype_name, "logprobs rel (last rows)", max_rel(lp.detach()[rows].double().cpu(), ref_lp), vb)
    table.le("a", check, dtype_name, "kl rel (last rows)", max_rel(kl.detach()[rows].double().cpu(), ref_kl), vb)
    table.le("a", check, dtype_name, "grad rel (last rows)", max_rel(p.grad[rows].double().cpu(), ref_grad), gb)


# ------------------------------------------------------------------------------------------------- losses
LOSS_CASES = [  # (label in tests/losses/_reference.CASES, batch)
    ("opd", "base"),
    ("opd", "large"),
    ("ref_kl_full", "base"),
    ("ref_kl_k3", "base"),
    ("sft", "base"),
    ("lsm_teacher", "base"),
    ("lsm_student", "base"),
    ("gkd", "base"),
    ("grpo", "base"),
    ("stable_opd", "base"),
    ("stable_opd", "large"),
]
_FLOAT_FIELDS = (
    "logits",
    "teacher_logits",
    "ref_logits",
    "golden_logits",
    "old_lp",
    "teacher_lp",
    "t_topk_lp",
    "s_topk_teacher_lp",
    "rewards",
)


@contextlib.contextmanager
def _reference_vocab(R, vocab: int):
    """tests/losses/_reference.make_batch draws its batches at the module's V: raise it for the call."""
    old = R.V
    R.V = vocab
    try:
        yield
    finally:
        R.V = old


def check_losses(table: Table, device, dtypes, vocab: int) -> None:
    try:
        from tests.losses import _reference as R
    except ImportError as e:
        table.fail(
            "a",
            "losses",
            "-",
            f"tests/losses/_reference.py not importable ({e}): run from the repository root with PYTHONPATH=$PWD",
        )
        return
    from megaopd.losses import LossInputs, build_loss

    cases = {(lab, b): (name, cfg) for lab, b, name, cfg in R.CASES}
    with _reference_vocab(R, vocab):
        batches = {b: R.make_batch(**R.BATCHES[b]) for _, b in LOSS_CASES}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        vb, gb = BOUND[dtype_name]
        for label, bname in LOSS_CASES:
            with table.guard("a", f"loss {label} {bname}", dtype_name):
                name, cfg = cases[(label, bname)]
                batch = dict(batches[bname])
                for k in _FLOAT_FIELDS:  # the reference sees exactly the inputs the code gets
                    batch[k] = batch[k].to(dtype).double()
                ref_loss, ref_grad, ref_golden = R.reference_value_and_grads(batch, name, cfg)
                logits = batch["logits"].to(device, dtype).requires_grad_()
                golden = batch["golden_logits"].to(device, dtype).requires_grad_()
                d = lambda t, dt=None: None if t is None else t.to(device, dt) if dt else t.to(device)  # noqa: E731
                inputs = LossInputs(
                    logits_BTv=logits,
                    token_ids_BT=d(batch["ids"]),
                    loss_mask_BT=d(batch["mask"]),
                    temperature=batch["temperature"],
                    seq_ids_BT=d(batch["seq_ids"]),
                    old_logprobs_BT=d(batch["old_lp"], dtype),
                    teacher_logprobs_BT=d(batch["teacher_lp"], dtype),
                    teacher_topk_ids_BTK=d(batch["t_topk_ids"]),
                    teacher_topk_logprobs_BTK=d(batch["t_topk_lp"], dtype),
                    teacher_topk_mask_BTK=d(batch["t_topk_mask"]),
                    student_topk_ids_BTK=d(batch["s_topk_ids"]),
                    student_topk_teacher_logprobs_BTK=d(batch["s_topk_teacher_lp"], dtype),
                    teacher_logits_BTv=d(batch["teacher_logits"], dtype),
                    ref_logits_BTv=d(batch["ref_logits"], dtype),
                    rewards_S=d(batch["rewards"], dtype),
                    group_ids_S=d(batch["groups"]),
                    golden_logits_BTv=golden,
                    golden_ids_BT=d(batch["golden_ids"]),
                    golden_mask_BT=d(batch["golden_mask"]),
                )
                loss = build_loss(name, cfg)(inputs).total
                loss.backward()
                big = 10 if bname == "large" else 1
                rel = abs(float(loss) - ref_loss) / max(abs(ref_loss), 1e-2)
                table.le("a", f"loss {label} ({bname})", dtype_name, "loss rel", rel, vb * big * 2)
                g = logits.grad if logits.grad is not None else torch.zeros_like(logits)
                table.le("a", f"loss {label} ({bname})", dtype_name, "grad rel", max_rel(g, ref_grad), gb * big * 2)
                if float(ref_golden.abs().max()) > 0:
                    table.le(
                        "a",
                        f"loss {label} ({bname})",
                        dtype_name,
                        "golden grad rel",
                        max_rel(golden.grad, ref_golden),
                        gb * big * 2,
                    )
