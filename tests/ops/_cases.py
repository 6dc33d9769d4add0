"""Test cases for megaopd.ops: inputs, the op outputs on one TP shard, and a float64 reference.

`run_case(case, rank, world_size, group)` computes every op on rank `rank`'s vocabulary shard and
returns small tensors (values, gradient shards); `reference(case, world_size)` computes the same from
the formulas on the full vocabulary in float64 with plain torch (it never calls megaopd.ops); `compare`
checks one against the other. The same functions serve TP=1 in-process and TP=2/4 in spawned workers
(tests/ops/_workers.py), so all checks of one world size share one spawn.

Gradients: every differentiable output `out` gets its own random weights w (same shape); we compare the
gradient of sum(w * out) w.r.t. the logits shard with the reference gradient's columns of that shard.
"""

from __future__ import annotations

import dataclasses
import math

import torch

V_FULL = 4 * 17  # divisible by TP = 1, 2 and 4
JSD_BETAS = (0.0, 0.3, 1.0)
TOPK_KS = (5, 20)  # 20 > V/TP = 17 at TP=4: one shard alone cannot supply all k
GATHER_K = 3
SUPPORT_K = 6


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lead: tuple  # leading (token) shape of the logits
    scale: float = 1.0  # logits = offset + scale * randn
    offset: float = 0.0
    temperature: float = 1.0
    chunk_size: int | None = None
    dtype: str = "float32"
    ties_across_shards: bool = False  # every shard a copy of shard 0: equal logits on different ranks
    pad_columns: int = 0  # the last pad_columns vocabulary columns are padding (-1e30) in p and q
    seed: int = 0


CASES = [
    Case("unit", (13,), scale=1.0, chunk_size=4),
    Case("ragged_2d_temp", (3, 5), scale=3.0, temperature=0.7, chunk_size=2, seed=1),
    Case("ragged_3d_hot", (2, 3, 2), scale=30.0, temperature=1.5, seed=2),
    Case("scale_1e3", (13,), scale=1e3, chunk_size=5, seed=3),
    Case("scale_1e4_temp", (1, 13), scale=1e4, temperature=0.8, chunk_size=3, seed=4),
    Case("offset_1e4", (13,), scale=4.0, offset=1e4, chunk_size=6, seed=5),
    Case("bf16", (13,), scale=5.0, temperature=1.3, chunk_size=4, dtype="bfloat16", seed=6),
    Case("ties", (13,), scale=2.0, chunk_size=4, ties_across_shards=True, seed=7),
    # 20 padding columns: at TP=4 the last shard is all padding and the one before partly.
    Case("padded", (13,), scale=4.0, temperature=0.9, chunk_size=4, pad_columns=20, seed=8),
]
PAD_LOGIT = -1e30  # megatron-style masked vocabulary padding (finite: -inf would make 0 * inf = nan)


def make_inputs(case: Case, world_size: int) -> dict:
    """Full-vocabulary inputs, identical in every process (seeded)."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    T = math.prod(case.lead)
    dtype = getattr(torch, case.dtype)

    def logits():
        if case.ties_across_shards:
            shard = torch.randn(T, V_FULL // world_size, generator=g, dtype=torch.float64)
            full = shard.repeat(1, world_size)
        else:
            full = torch.randn(T, V_FULL, generator=g, dtype=torch.float64)
        full = case.offset + case.scale * full
        if case.pad_columns:
            full[:, V_FULL - case.pad_columns :] = PAD_LOGIT
        return full.to(dtype).reshape(*case.lead, V_FULL)

    inputs = {"p": logits(), "q": logits()}
    inputs["ids"] = torch.randint(0, V_FULL, case.lead, generator=g) % (V_FULL - case.pad_columns)
    inputs["gather_ids"] = torch.randint(0, V_FULL, (*case.lead, GATHER_K), generator=g)
    # Support: distinct ids per token; some entries masked (their id and value are garbage on purpose),
    # and the first token's support entirely masked.
    perm = torch.stack([torch.randperm(V_FULL, generator=g)[:SUPPORT_K] for _ in range(T)])
    mask = torch.rand(T, SUPPORT_K, generator=g) < 0.7
    mask[:, 0] = True
    mask[0] = False
    inputs["support_ids"] = torch.where(mask, perm, torch.full_like(perm, -1)).reshape(*case.lead, SUPPORT_K)
    ref = torch.log_softmax(torch.randn(T, V_FULL, generator=g, dtype=torch.float64) * 2, -1).gather(
        1, perm.clamp(min=0)
    )
    inputs["support_ref"] = (
        torch.where(mask, ref, torch.full_like(ref, float("nan"))).float().reshape(*case.lead, SUPPORT_K)
    )
    inputs["support_mask"] = mask.reshape(*case.lead, SUPPORT_K)
    inputs["weights"] = {
        name: torch.randn(case.lead, generator=g, dtype=torch.float64) for name in differentiable_outputs()
    }
    # The fused op's weights come from their own stream, so the draws above are as they always were.
    gf = torch.Generator().manual_seed(2000 + case.seed)
    inputs["fused_weights"] = {
        name: torch.randn(case.lead, generator=gf, dtype=torch.float64) for name in ("logprobs", "kl")
    }
    return inputs


def differentiable_outputs() -> list[str]:
    return ["logprobs", "logsumexp", "entropy", "kl", "kl_frozen_q", "gather", "support_kl"] + [
        f"jsd_{b}" for b in JSD_BETAS
    ]


def _shard(x, rank, world_size):
    v = x.shape[-1] // world_size
    return x[..., rank * v : (rank + 1) * v]


def run_case(case: Case, rank: int, world_size: int, group, impl: str = "torch") -> dict:
    """All ops on this rank's shard. Returns {name: {"value": ..., "grad_p"/"grad_q": shard grads}}.
    impl: the ops' implementation ("torch", or "triton" under TRITON_INTERPRET=1 on CPU)."""
    from megaopd import ops

    inp = make_inputs(case, world_size)
    kw = dict(group=group, temperature=case.temperature, impl=impl)
    ckw = dict(kw, chunk_size=case.chunk_size)
    out = {}

    def leaf(name):
        return _shard(inp[name], rank, world_size).clone().requires_grad_()

    def record(name, value, p, q=None):
        w = inp["weights"][name]
        grads = torch.autograd.grad((value.double() * w).sum(), [p] if q is None else [p, q])
        res = {"value": value.detach().double(), "dtype": value.dtype}
        res.update({k: g.double() for k, g in zip(("grad_p", "grad_q"), grads)})
        out[name] = res

    p = leaf("p")
    record("logprobs", ops.vocab_parallel_logprobs(p, inp["ids"], **ckw), p)
    p = leaf("p")
    record("logsumexp", ops.vocab_parallel_logsumexp(p, **ckw), p)
    p = leaf("p")
    record("entropy", ops.vocab_parallel_entropy(p, **ckw), p)
    p, q = leaf("p"), leaf("q")
    record("kl", ops.vocab_parallel_kl(p, q, **ckw), p, q)
    p, q = leaf("p"), leaf("q")
    record("kl_frozen_q", ops.vocab_parallel_kl(p, q.detach(), **ckw), p)
    for beta in JSD_BETAS:
        p, q = leaf("p"), leaf("q")
        record(f"jsd_{beta}", ops.vocab_parallel_jsd(p, q, beta, **ckw), p, q)
    p = leaf("p")
    record("gather", ops.vocab_parallel_gather(p, inp["gather_ids"], group=group, impl=impl).sum(-1), p)
    p = leaf("p")
    record(
        "support_kl",
        ops.vocab_parallel_support_kl(
            p, inp["support_ids"], inp["support_ref"], support_mask=inp["support_mask"], **kw
        ),
        p,
    )
    for k in TOPK_KS:
        logprobs, ids = ops.vocab_parallel_topk(_shard(inp["p"], rank, world_size), k, **ckw)
        out[f"topk_{k}"] = {
            "value": logprobs.double(),
            "ids": ids,
            "dtype": logprobs.dtype,
            "requires_grad": logprobs.requires_grad,
        }
    out["fused"] = _run_fused(inp, rank, world_size, ckw)
    return out


FUSED_LOSSES = ("both", "logprobs_only", "kl_only")  # which outputs the loss reads (the others: no grad)


def _fused_losses(logprobs, kl, weights):
    w_lp, w_kl = weights["logprobs"], weights["kl"]
    return {
        "both": (logprobs.double() * w_lp).sum() + (kl.double() * w_kl).sum(),
        "logprobs_only": (logprobs.double() * w_lp).sum(),
        "kl_only": (kl.double() * w_kl).sum(),
    }


def _run_fused(inp, rank, world_size, ckw) -> dict:
    """vocab_parallel_logprobs_kl (q frozen) and, for comparison, the unfused ops on the same shard."""
    from megaopd import ops

    q = _shard(inp["q"], rank, world_size)
    res = {}
    for impl in ("fused", "unfused"):
        for loss_name in FUSED_LOSSES:
            p = _shard(inp["p"], rank, world_size).clone().requires_grad_()
            if impl == "fused":
                logprobs, kl, entropy = ops.vocab_parallel_logprobs_kl(p, inp["ids"], q, with_entropy=True, **ckw)
            else:
                logprobs = ops.vocab_parallel_logprobs(p, inp["ids"], **ckw)
                kl = ops.vocab_parallel_kl(p, q, **ckw)
                entropy = ops.vocab_parallel_entropy(p.detach(), **ckw)
            (grad,) = torch.autograd.grad(_fused_losses(logprobs, kl, inp["fused_weights"])[loss_name], p)
            res[(impl, loss_name)] = {
                "logprobs": logprobs.detach().double(),
                "kl": kl.detach().double(),
                "entropy": entropy.double(),
                "grad_p": grad.double(),
                "dtypes": (logprobs.dtype, kl.dtype, entropy.dtype),
                "entropy_requires_grad": entropy.requires_grad,
            }
    return res


# ---- float64 reference, from the formulas on the full vocabulary --------------------------------------


def reference(case: Case, world_size: int) -> dict:
    inp = make_inputs(case, world_size)
    tau = case.temperature
    p = inp["p"].double().requires_grad_()
    q = inp["q"].double().requires_grad_()
    logp = torch.log_softmax(p / tau, dim=-1)
    logq = torch.log_softmax(q / tau, dim=-1)

    def kl(log_a, log_b):
        return (log_a.exp() * (log_a - log_b)).sum(-1)

    values = {
        "logprobs": logp.gather(-1, inp["ids"].unsqueeze(-1)).squeeze(-1),
        "logsumexp": torch.logsumexp(p / tau, dim=-1),
        "entropy": -(logp.exp() * logp).sum(-1),
        "kl": kl(logp, logq),
        "kl_frozen_q": kl(logp, logq.detach()),
        "gather": p.gather(-1, inp["gather_ids"]).sum(-1),
    }
    for beta in JSD_BETAS:
        if beta == 0.0:
            values[f"jsd_{beta}"] = kl(logq, logp)  # forward KL(teacher || student)
        elif beta == 1.0:
            values[f"jsd_{beta}"] = kl(logp, logq)  # reverse KL(student || teacher)
        else:
            # M = beta q + (1 - beta) p, in log space so nothing underflows to log 0
            log_m = torch.logaddexp(math.log(beta) + logq, math.log(1 - beta) + logp)
            values[f"jsd_{beta}"] = beta * kl(logq, log_m) + (1 - beta) * kl(logp, log_m)
    values["support_kl"] = _reference_support_kl(logp, inp)

    out = {}
    for name, value in values.items():
        grads = torch.autograd.grad((value * inp["weights"][name]).sum(), [p, q], retain_graph=True, allow_unused=True)
        out[name] = {"value": value.detach(), "grad_p": grads[0], "grad_q": grads[1]}
    out["fused"] = _reference_fused(inp, tau)
    for k in TOPK_KS:
        # Stable sort over ascending global ids: among equal log-probs the lower id comes first.
        sorted_lp, sorted_ids = logp.detach().sort(dim=-1, descending=True, stable=True)
        out[f"topk_{k}"] = {"value": sorted_lp[..., :k], "ids": sorted_ids[..., :k], "logp": logp.detach()}
    return out


def _reference_fused(inp, tau) -> dict:
    """Sampled-token log-prob, KL(p||q) with q frozen and H(p), and the gradients w.r.t. p of the
    FUSED_LOSSES, in float64 from the formulas."""
    out = {}
    for loss_name in FUSED_LOSSES:
        p = inp["p"].double().requires_grad_()
        logp = torch.log_softmax(p / tau, dim=-1)
        logq = torch.log_softmax(inp["q"].double() / tau, dim=-1)
        logprobs = logp.gather(-1, inp["ids"].unsqueeze(-1)).squeeze(-1)
        kl = (logp.exp() * (logp - logq)).sum(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        (grad,) = torch.autograd.grad(_fused_losses(logprobs, kl, inp["fused_weights"])[loss_name], p)
        out[loss_name] = {"logprobs": logprobs.detach(), "kl": kl.detach(), "entropy": entropy.detach(), "grad_p": grad}
    return out


def _reference_support_kl(logp, inp):
    """sum_{v in S} pihat (log pihat - log qhat), token by token over the unmasked support."""
    lead = logp.shape[:-1]
    logp_TV = logp.reshape(-1, logp.shape[-1])
    ids_TK = inp["support_ids"].reshape(-1, SUPPORT_K)
    ref_TK = inp["support_ref"].double().reshape(-1, SUPPORT_K)
    mask_TK = inp["support_mask"].reshape(-1, SUPPORT_K)
    rows = []
    for t in range(logp_TV.shape[0]):
        sel = mask_TK[t]
        if not sel.any():
            rows.append(logp_TV[t, 0] * 0.0)
            continue
        log_pi = logp_TV[t, ids_TK[t, sel]]
        log_pihat = log_pi - torch.logsumexp(log_pi, 0)
        log_qhat = ref_TK[t, sel] - torch.logsumexp(ref_TK[t, sel], 0)
        rows.append((log_pihat.exp() * (log_pihat - log_qhat)).sum())
    return torch.stack(rows).reshape(lead)


# ---- comparison ---------------------------------------------------------------------------------------


def tolerances(case: Case, world_size: int, weights: str = "weights") -> tuple[float, float, float]:
    """(rtol, rtol_grad, atol) for |got - want| <= atol + rtol * max(|want|, scale).

    float32 math on logits whose per-token spread (max - min) / temperature is D loses ~eps * D in every
    log-probability (e.g. logits of +-1e3 have an ulp of 6e-5), and gradients such as
    p (log p - log q - KL) subtract such terms: atol = eps D max|w| bounds that, and is still far below
    the O(|grad|) error of any wrong formula. bf16 logits get bf16 gradients (8-bit mantissa): rtol_grad.
    """
    inp = make_inputs(case, world_size)
    # Padding columns carry no probability: the spread is that of the real vocabulary.
    real = slice(0, V_FULL - case.pad_columns)
    spread = max(
        float((x[..., real].double().amax(-1) - x[..., real].double().amin(-1)).max()) for x in (inp["p"], inp["q"])
    )
    max_w = max(float(w.abs().max()) for w in inp[weights].values())
    atol = 1e-7 + 2.0**-23 * spread / case.temperature * max_w
    return 4e-6, (1e-2 if case.dtype == "bfloat16" else 4e-6), atol


def compare(case: Case, world_size: int, results_by_rank: list[dict], ref: dict) -> list[str]:
    """Every mismatch as a message (empty list: all good)."""
    errors = []
    rtol_v, rtol_g, atol = tolerances(case, world_size)

    def close(what, got, want, rtol, scale, atol=atol):
        """|got - want| <= atol + rtol * max(|want|, scale), elementwise."""
        if got.shape != want.shape:
            errors.append(f"{case.name} TP={world_size} {what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        elif not torch.isfinite(got).all():
            errors.append(f"{case.name} TP={world_size} {what}: non-finite values")
        else:
            err = (got - want).abs()
            if (err > atol + rtol * want.abs().clamp(min=scale)).any():
                errors.append(
                    f"{case.name} TP={world_size} {what}: max err {err.max().item():.3g} "
                    f"(ref max {want.abs().max().item():.3g})"
                )

    for name in differentiable_outputs():
        want = ref[name]
        for rank, res in enumerate(results_by_rank):
            got = res[name]
            if got["dtype"] != torch.float32:
                errors.append(f"{case.name} {name}: returned {got['dtype']}, expected float32")
            close(f"{name} value (rank {rank})", got["value"], want["value"], rtol_v, scale=0.0)
            if not torch.equal(got["value"], results_by_rank[0][name]["value"]):
                errors.append(f"{case.name} TP={world_size} {name}: ranks disagree")
        for which in ("grad_p", "grad_q"):
            if which not in results_by_rank[0][name]:
                continue
            got = torch.cat([res[name][which] for res in results_by_rank], dim=-1)
            want_g = want[which] if want[which] is not None else torch.zeros_like(got)
            close(f"{name} {which}", got, want_g, rtol_g, scale=want_g.abs().max().item())
    for k in TOPK_KS:
        want = ref[f"topk_{k}"]
        for rank, res in enumerate(results_by_rank):
            got = res[f"topk_{k}"]
            if got["requires_grad"] or got["dtype"] != torch.float32:
                errors.append(f"{case.name} topk_{k}: expected a float32 tensor without grad")
            close(f"topk_{k} values (rank {rank})", got["value"], want["value"], rtol_v, scale=0.0)
            ids = got["ids"]
            # Valid whatever the tie-breaking: distinct ids whose log-probs are the returned values.
            if (ids.sort(dim=-1).values.diff(dim=-1) == 0).any():
                errors.append(f"{case.name} TP={world_size} topk_{k}: repeated ids")
            close(f"topk_{k} logp at ids (rank {rank})", want["logp"].gather(-1, ids), got["value"], rtol_v, scale=0.0)
            # float32 random logits have no ties within a shard, so the order is fully determined:
            # across shards (the `ties` case) the lower global id first.
            if case.dtype == "float32" and not torch.equal(ids, want["ids"]):
                errors.append(
                    f"{case.name} TP={world_size} topk_{k} (rank {rank}): ids {ids.tolist()} != {want['ids'].tolist()}"
                )
    # Fused log-probs + KL (+ entropy): against the float64 reference, and against the unfused ops.
    atol = tolerances(case, world_size, "fused_weights")[2]
    for loss_name in FUSED_LOSSES:
        want = ref["fused"][loss_name]
        for impl in ("fused", "unfused"):
            for rank, res in enumerate(results_by_rank):
                got = res["fused"][(impl, loss_name)]
                what = f"{impl} {loss_name}"
                if impl == "fused" and (got["dtypes"] != (torch.float32,) * 3 or got["entropy_requires_grad"]):
                    errors.append(
                        f"{case.name} {what}: dtypes {got['dtypes']}, entropy requires grad "
                        f"{got['entropy_requires_grad']}; expected float32 and a no-grad entropy"
                    )
                for out in ("logprobs", "kl", "entropy"):
                    close(f"{what} {out} (rank {rank})", got[out], want[out], rtol_v, scale=0.0, atol=atol)
                    if not torch.equal(got[out], results_by_rank[0]["fused"][(impl, loss_name)][out]):
                        errors.append(f"{case.name} TP={world_size} {what} {out}: ranks disagree")
            got_g = torch.cat([res["fused"][(impl, loss_name)]["grad_p"] for res in results_by_rank], dim=-1)
            close(f"{what} grad_p", got_g, want["grad_p"], rtol_g, scale=want["grad_p"].abs().max().item(), atol=atol)
        for rank, res in enumerate(results_by_rank):  # fused == unfused, to the same tolerance
            fused, unfused = res["fused"][("fused", loss_name)], res["fused"][("unfused", loss_name)]
            for out in ("logprobs", "kl", "entropy", "grad_p"):
                scale = unfused[out].abs().max().item() if out == "grad_p" else 0.0
                close(
                    f"fused vs unfused {loss_name} {out} (rank {rank})",
                    fused[out],
                    unfused[out],
                    rtol_g if out == "grad_p" else rtol_v,
                    scale=scale,
                    atol=atol,
                )
    return errors
