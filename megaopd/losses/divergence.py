"""Differentiable divergence losses over the (vocab-parallel) distributions: SFT, reference KL, LSM, GKD.

sft (Stable-OPD 2604.08527 sec. 4; cold start of 2604.13016):
    l_t = -log pi_theta(y*_t | x, y*_<t) on golden tokens; aggregated over the golden counts.
ref_kl (Stable-OPD sec. 4), at student-visited prefixes s_t:
    estimator=full: l_t = sum_v pi_theta(v|s_t) (log pi_theta(v|s_t) - log pi_ref(v|s_t))   (exact, vocab-parallel)
    (LossInputs.student_ref_kl: with the reference logits in the record, stable_opd's log-probs, this KL
    and the entropy metric come from one fused pass, ops.vocab_parallel_logprobs_kl)
    k1: log rho, k2: (log rho)^2 / 2, k3: rho^-1 - 1 + log rho, with rho = pi_theta(y_t) / pi_ref(y_t)
    (single-sample estimators on the sampled token; note k1's gradient is the score function, zero in
    expectation, so k1 is mostly a metric; k2 and k3 are the usual loss choices).
lsm (teacher top-K local support matching, 2603.25562), S_t the support, hats = renormalized over S_t:
    l_t = sum_{v in S_t} pihat(v|s_t) (log pihat(v|s_t) - log qhat(v|s_t))
    support=teacher_topk: S_t = the teacher's top-K (K = 32, paper); support=student_topk: S_t = the
    student's top-k (k = 16, paper 2604.13016 code), whose ids the trainer computes with
    `student_topk_support` on the actor's pi_old pass and has the teacher score. Tokens outside S_t get
    no gradient.
gkd (Agarwal et al. 2024), M = beta q + (1 - beta) pi_theta:
    l_t = beta KL(q || M) + (1 - beta) KL(pi_theta || M)      (needs the teacher's full logits)

All per-token quantities come from megaopd.ops (full-vocabulary math on TP shards, exact, chunked);
nothing here touches a vocabulary dimension. Departure: for lsm/student_topk the support is the top-k of
pi_old (what the teacher could score before the update), which is the current student's at the first
micro-batch of an on-policy step.

    pytest tests/losses -k "sft or ref_kl or lsm or gkd"
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaopd import ops
from megaopd.losses.aggregation import aggregate, check_aggregation, masked_mean
from megaopd.losses.inputs import LossInputs
from megaopd.losses.needs import LossNeeds
from megaopd.losses.registry import Metrics, register_loss
from megaopd.ops.head import LogitsHead, tokenwise

KL_ESTIMATORS = ("full", "k1", "k2", "k3")
LSM_SUPPORTS = ("teacher_topk", "student_topk")


@dataclass
class SFTConfig:
    """Token NLL on golden (dataset) solutions."""

    aggregation: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum over the golden tokens (aggregation.py)."""

    def __post_init__(self):
        check_aggregation(self.aggregation)


@dataclass
class RefKLConfig:
    """KL(pi_theta || pi_ref) at the on-policy prefixes."""

    estimator: str = "full"
    """"full" (exact over the vocabulary, vocab-parallel; needs ref_logits_BTv) or "k1" | "k2" | "k3"
    (sampled token; needs ref_logprobs_BT or ref_logits_BTv)."""
    aggregation: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum over the on-policy tokens."""

    def __post_init__(self):
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(f"estimator={self.estimator!r} is not one of {KL_ESTIMATORS}")
        check_aggregation(self.aggregation)


@dataclass
class LSMConfig:
    """Local support matching: reverse KL renormalized over a top-k support."""

    support: str = "teacher_topk"
    """"teacher_topk" (paper 2603.25562) or "student_topk" (paper 2604.13016 code)."""
    k: int | None = None
    """Support size; None = 32 for teacher_topk, 16 for student_topk (papers). The first k columns of the
    provided [B, T, K] support are used (they are sorted by decreasing log-prob), so K >= k is required."""
    aggregation: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum over the on-policy tokens."""

    def __post_init__(self):
        if self.support not in LSM_SUPPORTS:
            raise ValueError(f"support={self.support!r} is not one of {LSM_SUPPORTS}")
        if self.k is None:
            self.k = 32 if self.support == "teacher_topk" else 16
        if self.k < 1:
            raise ValueError(f"k={self.k} must be >= 1 (paper: 32 teacher_topk, 16 student_topk)")
        check_aggregation(self.aggregation)


@dataclass
class GKDConfig:
    """Generalized JSD(beta) to the teacher over the full vocabulary."""

    beta: float = 0.5
    """Mixture weight of the teacher in M (ours: 0.5, TRL's default); strictly inside (0, 1)."""
    aggregation: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum over the on-policy tokens."""

    def __post_init__(self):
        if not 0.0 < self.beta < 1.0:
            raise ValueError(
                f"beta={self.beta} must be in (0, 1): at 0 or 1 the JSD(beta) is identically 0; "
                f"use ref_kl-style KL losses for the one-sided limits"
            )
        check_aggregation(self.aggregation)


def _aggregate_on_policy(loss_BT, inputs: LossInputs, aggregation: str) -> torch.Tensor:
    return aggregate(
        loss_BT,
        inputs.loss_mask_BT,
        inputs.seq_ids,
        inputs.num_seqs,
        aggregation,
        inputs.global_num_tokens,
        inputs.global_num_seqs,
    )


@register_loss("sft", SFTConfig, needs=LossNeeds(golden=True))
def sft_loss(inputs: LossInputs, config: SFTConfig) -> tuple[torch.Tensor, Metrics]:
    """Golden-token NLL. Needs: golden_logits_BTv, golden_ids_BT, golden_mask_BT. Divides by
    global_num_golden_tokens (token-mean) or global_num_golden_seqs (seq-mean-*)."""
    logits = inputs.need("golden_logits_BTv", "sft")
    ids_BT = inputs.need("golden_ids_BT", "sft")
    mask_BT = inputs.need("golden_mask_BT", "sft")
    if logits is inputs.logits_BTv and ids_BT is inputs.token_ids_BT:
        logprobs_BT = inputs.student_logprobs()  # golden rows share the on-policy forward: reuse its log-probs
    else:
        logprobs_BT = tokenwise(
            lambda z, ids: ops.vocab_parallel_logprobs(z, ids, group=inputs.tp_group, temperature=inputs.temperature),
            logits,
            ids_BT,
        )
    nll_BT = -logprobs_BT
    if inputs.golden_seq_ids_BT is not None:
        seq_ids_BT = inputs.golden_seq_ids_BT
        num_seqs = lambda: int(seq_ids_BT.max().item()) + 1 if seq_ids_BT.numel() else 0  # noqa: E731
    else:
        seq_ids_BT = lambda: torch.arange(ids_BT.shape[0], device=ids_BT.device)[:, None].expand_as(ids_BT)  # noqa: E731
        num_seqs = ids_BT.shape[0]
    loss = aggregate(
        nll_BT,
        mask_BT,
        seq_ids_BT,
        num_seqs,
        config.aggregation,
        inputs.global_num_golden_tokens,
        inputs.global_num_golden_seqs,
    )
    return loss, {"sft/nll": masked_mean(nll_BT, mask_BT), "sft/num_tokens": mask_BT.detach().sum().to(nll_BT.dtype)}


@register_loss("ref_kl", RefKLConfig, needs=LossNeeds(reference=True))
def ref_kl_loss(inputs: LossInputs, config: RefKLConfig) -> tuple[torch.Tensor, Metrics]:
    """KL(pi_theta || pi_ref). Needs: ref_logits_BTv (full), or ref_logprobs_BT / ref_logits_BTv (k1-k3).
    Divides by global_num_tokens (token-mean) or global_num_seqs (seq-mean-*)."""
    mask_BT = inputs.loss_mask_BT
    if config.estimator == "full":
        # Cached, and fused with the student log-probs / entropy when the record allows (LossInputs).
        kl_BT = inputs.student_ref_kl("ref_kl")
    else:
        log_ratio_BT = inputs.student_logprobs() - inputs.reference_logprobs("ref_kl")
        if config.estimator == "k1":
            kl_BT = log_ratio_BT
        elif config.estimator == "k2":
            kl_BT = 0.5 * log_ratio_BT**2
        else:
            # rho^-1 - 1 + log rho; expm1 keeps it accurate (and >= 0) when rho is near 1.
            kl_BT = torch.expm1(-log_ratio_BT) + log_ratio_BT
    loss = _aggregate_on_policy(kl_BT, inputs, config.aggregation)
    return loss, {"ref_kl/kl": masked_mean(kl_BT, mask_BT)}


def student_topk_support(
    logits_BTv: torch.Tensor | LogitsHead, k: int, group=None, temperature: float = 1.0
) -> torch.Tensor:
    """The student's top-k global ids [B, T, k] (sorted by decreasing probability), for lsm
    support=student_topk: the trainer calls it on the pi_old pass and has the teacher score these ids."""
    with torch.no_grad():
        _, ids_BTK = tokenwise(
            lambda z: ops.vocab_parallel_topk(z, k, group=group, temperature=temperature), logits_BTv.detach()
        )
    return ids_BTK


@register_loss(
    "lsm",
    LSMConfig,
    needs=lambda c: LossNeeds(teacher_topk=c.k) if c.support == "teacher_topk" else LossNeeds(student_topk=c.k),
)
def lsm_loss(inputs: LossInputs, config: LSMConfig) -> tuple[torch.Tensor, Metrics]:
    """Top-k support matching. Needs: teacher_topk_ids_BTK + teacher_topk_logprobs_BTK (teacher_topk) or
    student_topk_ids_BTK + student_topk_teacher_logprobs_BTK (student_topk). Divides like opd."""
    if config.support == "teacher_topk":
        ids_BTK = inputs.need("teacher_topk_ids_BTK", "lsm")
        ref_BTK = inputs.need("teacher_topk_logprobs_BTK", "lsm")
        support_mask_BTK = inputs.teacher_topk_mask_BTK
    else:
        ids_BTK = inputs.need("student_topk_ids_BTK", "lsm")
        ref_BTK = inputs.need("student_topk_teacher_logprobs_BTK", "lsm")
        support_mask_BTK = None
    if ids_BTK.shape[-1] < config.k:
        raise ValueError(
            f"lsm k={config.k} but the {config.support} support has only {ids_BTK.shape[-1]} "
            f"ids per token; score a larger top-K or set lsm k<={ids_BTK.shape[-1]}"
        )
    ids_BTK, ref_BTK = ids_BTK[..., : config.k], ref_BTK[..., : config.k].detach()
    if support_mask_BTK is not None:
        support_mask_BTK = support_mask_BTK[..., : config.k]
    kl_BT = tokenwise(
        lambda z, ids, ref, mask: ops.vocab_parallel_support_kl(
            z, ids, ref, group=inputs.tp_group, temperature=inputs.temperature, support_mask=mask
        ),
        inputs.logits_BTv,
        ids_BTK,
        ref_BTK,
        support_mask_BTK,
    )
    loss = _aggregate_on_policy(kl_BT, inputs, config.aggregation)
    with torch.no_grad():
        # Teacher probability mass on the support: how much of q the renormalized loss sees.
        masked_ref_BTK = (
            ref_BTK
            if support_mask_BTK is None
            else torch.where(support_mask_BTK.bool(), ref_BTK, torch.full_like(ref_BTK, float("-inf")))
        )
        teacher_mass_BT = torch.logsumexp(masked_ref_BTK.float(), dim=-1).exp()
    return loss, {
        "lsm/kl": masked_mean(kl_BT, inputs.loss_mask_BT),
        "lsm/teacher_support_mass": masked_mean(teacher_mass_BT, inputs.loss_mask_BT),
    }


@register_loss("gkd", GKDConfig, needs=LossNeeds(teacher_logits=True))
def gkd_loss(inputs: LossInputs, config: GKDConfig) -> tuple[torch.Tensor, Metrics]:
    """Generalized JSD(beta). Needs: teacher_logits_BTv (in the student's vocab sharding). Divides like opd."""
    teacher_logits = inputs.need("teacher_logits_BTv", "gkd").detach()
    jsd_BT = tokenwise(
        lambda z, q: ops.vocab_parallel_jsd(z, q, config.beta, group=inputs.tp_group, temperature=inputs.temperature),
        inputs.logits_BTv,
        teacher_logits,
    )
    loss = _aggregate_on_policy(jsd_BT, inputs, config.aggregation)
    return loss, {"gkd/jsd": masked_mean(jsd_BT, inputs.loss_mask_BT)}
