"""Float64 single-process references for every loss, written from docs/algorithms.md with plain torch over the
full vocabulary (no megaopd code), plus the deterministic test batches shared by tests and workers.

Loops over sequences and positions are deliberate: they are the formulas read literally, independent of
the vectorized code under test.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

V = 24  # divisible by TP = 1, 2, 4; a TP=4 shard holds 6 ids (>= every k below)
K_TEACHER = 5
K_STUDENT = 4


# ------------------------------------------------------------------------------------------------ batches
def make_batch(
    seed: int,
    scale: float = 3.0,
    shift: float = 0.0,
    temperature: float = 1.0,
    packed: bool = False,
    spans: bool = False,
) -> dict:
    """Full-vocabulary float64 tensors for one micro-batch: B=4 rows of T=9 with ragged responses; spans: the
    span ids of a cross-tokenizer teacher (make_spans)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 9

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    logits = randn(B, T, V) * scale + shift
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T)
    for b, (start, length) in enumerate([(2, 7), (1, 3), (3, 5), (0, 1)]):  # ragged responses + padding
        mask[b, start : start + length] = 1
    mask[0, 4] = 0  # a hole inside a response (e.g. a masked special token)
    if packed:
        # Row 0 holds two sequences (positions 0-3 and 4-8); rows 1-3 are sequences 2-4.
        seq_ids = torch.tensor([[0] * 4 + [1] * 5] + [[s] * T for s in (2, 3, 4)])
        rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
        groups = torch.tensor([0, 0, 1, 1, 2])
    else:
        seq_ids = None
        rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
        groups = torch.tensor([0, 0, 1, 1])  # group 1 has zero reward variance
    tau = temperature
    old_lp = F.log_softmax((logits + 0.6 * randn(B, T, V)) / tau, -1).gather(-1, ids[..., None])[..., 0]
    teacher_logits = randn(B, T, V) * scale + shift
    teacher_lp_full = F.log_softmax(teacher_logits / tau, -1)
    t_topk_lp, t_topk_ids = teacher_lp_full.topk(K_TEACHER, dim=-1)
    t_topk_mask = torch.ones(B, T, K_TEACHER, dtype=torch.bool)
    t_topk_mask[1, :, -2:] = False  # fewer valid support entries on some tokens
    t_topk_mask[2, 4, 1:] = False  # a support of one token: KL 0
    s_topk_ids = F.log_softmax(logits / tau, -1).topk(K_STUDENT, dim=-1).indices
    ref_logits = logits + 0.5 * scale * randn(B, T, V)
    golden_logits = randn(2, 6, V) * scale + shift
    golden_ids = torch.randint(0, V, (2, 6), generator=g)
    golden_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.float32)
    return dict(
        spans=make_spans(g, mask, seq_ids) if spans else None,
        logits=logits,
        ids=ids,
        mask=mask,
        seq_ids=seq_ids,
        temperature=temperature,
        old_lp=old_lp,
        teacher_lp=teacher_lp_full.gather(-1, ids[..., None])[..., 0],
        teacher_logits=teacher_logits,
        t_topk_ids=t_topk_ids,
        t_topk_lp=t_topk_lp,
        t_topk_mask=t_topk_mask,
        s_topk_ids=s_topk_ids,
        s_topk_teacher_lp=teacher_lp_full.gather(-1, s_topk_ids),
        ref_logits=ref_logits,
        rewards=rewards,
        groups=groups,
        golden_logits=golden_logits,
        golden_ids=golden_ids,
        golden_mask=golden_mask,
    )


def make_spans(g: torch.Generator, mask: torch.Tensor, seq_ids) -> torch.Tensor:
    """Span ids [B, T] as a cross-tokenizer teacher's alignment gives them: runs of 1-3 positions numbered
    from 0 in each sequence, a -1 (a special token) inside some responses; outside the loss mask arbitrary
    values in {-1, 0, 1} (prompt and padding hold whatever the scorer left: the loss must not read them)."""
    B, T = mask.shape
    seq = seq_ids if seq_ids is not None else torch.arange(B)[:, None].expand(B, T)
    out = torch.randint(-1, 2, (B, T), generator=g)
    for b in range(B):
        t, prev_seq, span = 0, None, 0
        while t < T:
            if seq[b, t] != prev_seq:
                prev_seq, span = seq[b, t], 0
            if not mask[b, t] and not (b == 0 and t == 4):  # the hole of row 0 sits inside a span
                t += 1
                continue
            run = int(torch.randint(1, 4, (), generator=g))
            for u in range(t, min(t + run, T)):
                if seq[b, u] != prev_seq:
                    break
                out[b, u] = span
            span += 1
            t += max(1, min(run, T - t))
    out[0, 7] = -1  # special tokens inside responses: no counterpart
    out[2, 3] = -1
    return out


BATCHES = {
    "base": dict(seed=1),
    "large": dict(seed=2, scale=40.0, shift=500.0, temperature=0.7),
    "packed": dict(seed=3, scale=2.0, temperature=1.3, packed=True),
    "spans": dict(seed=4, spans=True),
    "spans_packed": dict(seed=5, scale=2.0, temperature=1.3, packed=True, spans=True),
}

# (case label, batch, loss name, config)
CASES = [
    ("opd", "base", "opd", {}),
    ("opd", "large", "opd", {}),
    ("opd", "packed", "opd", {}),
    (
        "opd_is_gamma",
        "base",
        "opd",
        dict(policy_loss="importance_sampling", gamma=0.9, advantage_scale=0.5, aggregation="seq-mean-token-mean"),
    ),
    (
        "opd_is_gamma",
        "packed",
        "opd",
        dict(policy_loss="importance_sampling", gamma=0.9, advantage_scale=0.5, aggregation="seq-mean-token-mean"),
    ),
    ("opd_gamma1_seqsum", "large", "opd", dict(gamma=1.0, eps_high=0.28, aggregation="seq-mean-token-sum")),
    # A teacher with another tokenizer: rewards and advantages over aligned spans.
    ("opd", "spans", "opd", {}),
    ("opd", "spans_packed", "opd", dict(aggregation="seq-mean-token-mean")),
    ("opd_is_gamma", "spans", "opd", dict(policy_loss="importance_sampling", gamma=0.9, advantage_scale=0.5)),
    ("opd_is_gamma", "spans_packed", "opd", dict(policy_loss="importance_sampling", gamma=0.9)),
    ("opd_gamma1_seqsum", "spans", "opd", dict(gamma=1.0, eps_high=0.28, aggregation="seq-mean-token-sum")),
    ("stable_opd", "spans", "stable_opd", dict(sft_weight=0.5, ref_kl_weight=0.3)),
    ("ref_kl_full", "base", "ref_kl", {}),
    ("ref_kl_full", "large", "ref_kl", {}),
    ("ref_kl_k1", "base", "ref_kl", dict(estimator="k1")),
    ("ref_kl_k2", "base", "ref_kl", dict(estimator="k2")),
    ("ref_kl_k3", "base", "ref_kl", dict(estimator="k3")),
    ("ref_kl_k3", "large", "ref_kl", dict(estimator="k3", aggregation="seq-mean-token-mean")),
    ("sft", "base", "sft", {}),
    ("sft", "large", "sft", {}),
    ("sft_seqmean", "base", "sft", dict(aggregation="seq-mean-token-mean")),
    ("lsm_teacher", "base", "lsm", dict(k=K_TEACHER)),
    ("lsm_teacher", "large", "lsm", dict(k=K_TEACHER)),
    ("lsm_teacher", "packed", "lsm", dict(k=K_TEACHER, aggregation="seq-mean-token-mean")),
    ("lsm_teacher_k3", "base", "lsm", dict(k=3)),
    ("lsm_student", "base", "lsm", dict(support="student_topk", k=K_STUDENT)),
    ("lsm_student", "large", "lsm", dict(support="student_topk", k=K_STUDENT)),
    ("gkd", "base", "gkd", {}),
    ("gkd", "large", "gkd", {}),
    ("gkd_b02", "packed", "gkd", dict(beta=0.2)),
    ("grpo", "base", "grpo", {}),
    ("grpo", "packed", "grpo", {}),
    ("dr_grpo", "base", "grpo", dict(std_normalize=False, aggregation="seq-mean-token-mean")),
    ("stable_opd", "base", "stable_opd", dict(sft_weight=0.5, ref_kl_weight=0.3)),
    ("stable_opd", "large", "stable_opd", dict(sft_weight=0.5, ref_kl_weight=0.3)),
    (
        "weighted_sum",
        "base",
        "weighted_sum",
        dict(
            terms=[
                dict(name="opd"),
                dict(name="lsm", weight=0.5, config=dict(k=K_TEACHER)),
                dict(name="gkd", weight=0.25),
                dict(name="ref_kl", weight=0.1, config=dict(estimator="k3")),
            ]
        ),
    ),
]


# ------------------------------------------------------------------------------------------------ references
def _seq_ids(batch, rows: int | None = None, T: int | None = None, packed_ids=None):
    if packed_ids is not None:
        return packed_ids
    return torch.arange(rows)[:, None].expand(rows, T)


def ref_aggregate(loss_BT, mask_BT, seq_ids_BT, mode):
    """The three aggregation modes, literally, over this one (whole) batch."""
    on = mask_BT.bool()
    if mode == "token-mean":
        return sum(loss_BT[b, t] for b, t in on.nonzero().tolist()) / max(int(on.sum()), 1)
    per_seq = {}
    for b, t in on.nonzero().tolist():
        per_seq.setdefault(int(seq_ids_BT[b, t]), []).append(loss_BT[b, t])
    if mode == "seq-mean-token-sum":
        vals = [sum(v) for v in per_seq.values()]
    else:
        vals = [sum(v) / len(v) for v in per_seq.values()]
    return sum(vals) / max(len(vals), 1)


def ref_logprobs(logits, ids, tau):
    return F.log_softmax(logits / tau, -1).gather(-1, ids[..., None])[..., 0]


def ref_discounted(rewards_BT, seq_ids_BT, gamma):
    B, T = rewards_BT.shape
    out = torch.zeros_like(rewards_BT)
    for b in range(B):
        for t in range(T):
            total, power = 0.0, 1.0
            for u in range(t, T):
                if seq_ids_BT[b, u] != seq_ids_BT[b, t]:
                    break
                total = total + power * rewards_BT[b, u]
                power *= gamma
            out[b, t] = total
    return out


def ref_span_advantages(batch, seq_ids_BT, gamma):
    """Cross-tokenizer opd (docs/algorithms.md): a span's reward R_s is the sum of teacher - old over its
    counted tokens (loss mask on, span id >= 0); every token of span s gets
    A = sum over spans s' of the same sequence ending at or after s of gamma^(end(s') - end(s)) R_s',
    end = the span's last counted position; positions without a span get 0."""
    spans, mask = batch["spans"], batch["mask"]
    B, T = mask.shape
    members = {}
    for b in range(B):
        for t in range(T):
            if mask[b, t] and spans[b, t] >= 0:
                members.setdefault((int(seq_ids_BT[b, t]), int(spans[b, t])), []).append((b, t))
    reward = {k: sum(batch["teacher_lp"][b, t] - batch["old_lp"][b, t] for b, t in v) for k, v in members.items()}
    end = {k: max(t for _, t in v) for k, v in members.items()}
    adv = torch.zeros(B, T, dtype=torch.float64)
    for key, positions in members.items():
        total = sum(
            gamma ** (end[other] - end[key]) * reward[other]
            for other in members
            if other[0] == key[0] and end[other] >= end[key]
        )
        for b, t in positions:
            adv[b, t] = total
    return adv


def ref_grpo_adv(rewards, groups, std_normalize, eps=1e-6):
    out = torch.zeros_like(rewards)
    for g in groups.unique().tolist():
        idx = (groups == g).nonzero()[:, 0]
        r = rewards[idx]
        std = r.std() if len(idx) > 1 else torch.tensor(0.0, dtype=r.dtype)
        out[idx] = (r - r.mean()) / (std + eps) if std_normalize else r - r.mean()
    return out


def _pg(logp, old, adv, policy_loss, eps_low, eps_high):
    ratio = torch.exp(logp - old)
    if policy_loss == "importance_sampling":
        return -ratio * adv, ratio
    return -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv), ratio


def reference_loss(batch: dict, logits, name: str, cfg: dict):
    """Float64 loss from the formulas; `logits` is the full student logits leaf to differentiate."""
    tau, mask, ids = batch["temperature"], batch["mask"], batch["ids"]
    B, T = ids.shape
    seq_ids = _seq_ids(batch, B, T, batch["seq_ids"])
    agg = cfg.get("aggregation", "token-mean")
    if name == "opd":
        logp = ref_logprobs(logits, ids, tau)
        r = torch.where(mask.bool(), batch["teacher_lp"] - batch["old_lp"], torch.zeros_like(logp))
        if batch.get("spans") is not None:
            adv = ref_span_advantages(batch, seq_ids, cfg.get("gamma", 0.0))
        else:
            adv = ref_discounted(r, seq_ids, cfg.get("gamma", 0.0))
        adv = cfg.get("advantage_scale", 1.0) * adv
        loss, _ = _pg(
            logp,
            batch["old_lp"],
            adv,
            cfg.get("policy_loss", "ppo_clip"),
            cfg.get("eps_low", 0.2),
            cfg.get("eps_high", 0.2),
        )
        return ref_aggregate(loss, mask, seq_ids, agg)
    if name == "grpo":
        logp = ref_logprobs(logits, ids, tau)
        adv_S = ref_grpo_adv(batch["rewards"], batch["groups"], cfg.get("std_normalize", True))
        adv = adv_S[seq_ids]
        loss, _ = _pg(logp, batch["old_lp"], adv, "ppo_clip", cfg.get("eps_low", 0.2), cfg.get("eps_high", 0.2))
        return ref_aggregate(loss, mask, seq_ids, agg)
    if name == "sft":
        gids = batch["golden_ids"]
        nll = -ref_logprobs(batch["golden_logits_leaf"], gids, tau)
        return ref_aggregate(nll, batch["golden_mask"], _seq_ids(batch, *gids.shape), agg)
    if name == "ref_kl":
        est = cfg.get("estimator", "full")
        if est == "full":
            lp = F.log_softmax(logits / tau, -1)
            lr = F.log_softmax(batch["ref_logits"] / tau, -1)
            kl = (lp.exp() * (lp - lr)).sum(-1)
        else:
            log_rho = ref_logprobs(logits, ids, tau) - ref_logprobs(batch["ref_logits"], ids, tau)
            kl = {"k1": log_rho, "k2": log_rho**2 / 2, "k3": torch.exp(-log_rho) - 1 + log_rho}[est]
        return ref_aggregate(kl, mask, seq_ids, agg)
    if name == "lsm":
        support = cfg.get("support", "teacher_topk")
        k = cfg.get("k", 32 if support == "teacher_topk" else 16)
        if support == "teacher_topk":
            sids, q, valid = batch["t_topk_ids"][..., :k], batch["t_topk_lp"][..., :k], batch["t_topk_mask"][..., :k]
        else:
            sids, q = batch["s_topk_ids"][..., :k], batch["s_topk_teacher_lp"][..., :k]
            valid = torch.ones_like(sids, dtype=torch.bool)
        lp = F.log_softmax(logits / tau, -1)
        kl = torch.zeros(B, T, dtype=torch.float64)
        for b in range(B):
            for t in range(T):
                sel = valid[b, t]
                p_s = lp[b, t, sids[b, t][sel]]
                q_s = q[b, t][sel]
                p_hat = p_s - torch.logsumexp(p_s, 0)
                q_hat = q_s - torch.logsumexp(q_s, 0)
                kl[b, t] = (p_hat.exp() * (p_hat - q_hat)).sum()
        return ref_aggregate(kl, mask, seq_ids, agg)
    if name == "gkd":
        beta = cfg.get("beta", 0.5)
        lp = F.log_softmax(logits / tau, -1)
        lq = F.log_softmax(batch["teacher_logits"] / tau, -1)
        m = beta * lq.exp() + (1 - beta) * lp.exp()
        log_m = torch.logaddexp(lq + math.log(beta), lp + math.log(1 - beta))  # = log m, stable
        assert torch.allclose(log_m.exp(), m)
        jsd = beta * (lq.exp() * (lq - log_m)).sum(-1) + (1 - beta) * (lp.exp() * (lp - log_m)).sum(-1)
        return ref_aggregate(jsd, mask, seq_ids, agg)
    if name == "stable_opd":
        return (
            reference_loss(batch, logits, "opd", cfg.get("opd", {}))
            + cfg.get("sft_weight", 0.1) * reference_loss(batch, logits, "sft", cfg.get("sft", {}))
            + cfg.get("ref_kl_weight", 0.01) * reference_loss(batch, logits, "ref_kl", cfg.get("ref_kl", {}))
        )
    if name == "weighted_sum":
        return sum(
            t.get("weight", 1.0) * reference_loss(batch, logits, t["name"], t.get("config", {})) for t in cfg["terms"]
        )
    raise KeyError(name)


def reference_value_and_grads(batch: dict, name: str, cfg: dict):
    """(loss, d loss / d student logits [B, T, V], d loss / d golden logits) in float64."""
    logits = batch["logits"].clone().requires_grad_(True)
    golden = batch["golden_logits"].clone().requires_grad_(True)
    loss = reference_loss(dict(batch, golden_logits_leaf=golden), logits, name, cfg)
    g_logits, g_golden = torch.autograd.grad(loss, [logits, golden], allow_unused=True)
    zero = torch.zeros_like
    return (
        float(loss.detach()),
        g_logits if g_logits is not None else zero(logits),
        g_golden if g_golden is not None else zero(golden),
    )


def reference_first_occurrence_mask(ids, mask, special, seq_ids=None):
    out = mask.clone()
    B, T = ids.shape
    for b in range(B):
        seen = set()
        for t in range(T):
            key = (int(seq_ids[b, t]) if seq_ids is not None else b, int(ids[b, t]))
            if mask[b, t] and int(ids[b, t]) in special and key not in seen:
                seen.add(key)
                out[b, t] = 0
    return out
