"""Policy-gradient losses with token-level advantages: sampled-token OPD and GRPO.

OPD (Lu & Thinking Machines 2025; Stable-OPD paper 2604.08527 sec. 3.1), per response token t:
    r_t   = log q(y_t|s_t) - log pi_old(y_t|s_t)                     (reverse-KL reward, sampled token)
    A_t   = c * sum_{t' >= t, same response} gamma^(t'-t) r_t'      (defaults c = 1, gamma = 0: A_t = r_t)
    rho_t = exp(log pi_theta(y_t|s_t) - log pi_old(y_t|s_t))
    ppo_clip:            l_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)
    importance_sampling: l_t = -rho_t A_t                              (Tinker; unclipped)
GRPO (DeepSeekMath; Dr. GRPO option): A_i = (R_i - mean_g R) / (std_g R + eps) for response i of prompt
group g (std_normalize=False: A_i = R_i - mean_g R), broadcast to every token of response i; same l_t.
Both aggregate l_t with the configured mode (aggregation.py); advantages are constants (detached).
loss.off_policy_correction (off_policy.py) multiplies l_t by tis / mis weights, or (recompute) takes OPD's
r_t against the training forward's detached log pi_theta instead of log pi_old.

Under a teacher with another tokenizer (LossInputs.teacher_spans_BT) OPD's reward is taken over aligned
text spans and each token of a span gets the span's advantage (cross_tokenizer.py); spans None: the above.

Departures / choices (ours): rewards of tokens outside the loss mask (prompt, padding, special tokens
masked by masking.py) are set to 0 before the discounted sum, so a masked "<|im_end|>" cannot leak its
teacher score into earlier advantages; the discount still counts positions. The group std is the
unbiased one (torch.std, as in verl/TRL); a group of one sample gets advantage 0.

    pytest tests/losses -k "opd or grpo"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megaopd.losses.aggregation import aggregate, check_aggregation, masked_max, masked_mean, masked_means
from megaopd.losses.cross_tokenizer import place_at_span_ends, take_at_span_ends
from megaopd.losses.inputs import LossInputs
from megaopd.losses.needs import LossNeeds
from megaopd.losses.off_policy import correction_metrics, correction_weights, reward_baseline
from megaopd.losses.registry import Metrics, register_loss

POLICY_LOSSES = ("ppo_clip", "importance_sampling")


def _check_policy(policy_loss: str, eps_low: float, eps_high: float, aggregation: str) -> None:
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"policy_loss={policy_loss!r} is not one of {POLICY_LOSSES}")
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low={eps_low} must be in [0, 1) (the ratio's lower clip is 1 - eps_low)")
    if eps_high < 0.0:
        raise ValueError(f"eps_high={eps_high} must be >= 0")
    check_aggregation(aggregation)


@dataclass
class OPDConfig:
    """Sampled-token on-policy distillation (reverse-KL advantage, PPO-clip or IS)."""

    policy_loss: str = "ppo_clip"
    """"ppo_clip" (default) or "importance_sampling" (unclipped rho * A, Tinker's `loss: importance_sampling`)."""
    eps_low: float = 0.2
    """Lower clip: ratio floor 1 - eps_low (ours: 0.2)."""
    eps_high: float = 0.2
    """Upper clip: ratio ceiling 1 + eps_high (ours: 0.2)."""
    advantage_scale: float = 1.0
    """c in A_t = c * sum gamma^(t'-t) r_t' (paper default 1)."""
    gamma: float = 0.0
    """Discount over later tokens of the same response (paper default 0: A_t = c * r_t)."""
    aggregation: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum (aggregation.py)."""
    log_entropy: bool = True
    """Add the student's full-vocabulary entropy as a metric (one extra no-grad pass over the logits)."""

    def __post_init__(self):
        _check_policy(self.policy_loss, self.eps_low, self.eps_high, self.aggregation)
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma={self.gamma} must be in [0, 1] (0 = per-token reward, the paper default)")


@dataclass
class GRPOConfig:
    """GRPO with group-normalized verifiable rewards, broadcast to tokens, PPO-clip."""

    eps_low: float = 0.2
    """Lower clip: ratio floor 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip: ratio ceiling 1 + eps_high."""
    std_normalize: bool = True
    """Divide by the group's reward std; False = Dr. GRPO (mean-centered only)."""
    eps: float = 1e-6
    """Added to the group std (spec: 1e-6)."""
    aggregation: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum (aggregation.py)."""
    log_entropy: bool = True
    """Add the student's full-vocabulary entropy as a metric."""

    def __post_init__(self):
        _check_policy("ppo_clip", self.eps_low, self.eps_high, self.aggregation)
        if self.eps <= 0:
            raise ValueError(f"eps={self.eps} must be > 0 (it keeps a zero-variance group finite)")


def discounted_returns(
    rewards_BT: torch.Tensor, seq_ids_BT: torch.Tensor | Callable[[], torch.Tensor], gamma: float
) -> torch.Tensor:
    """G_t = sum_{t' >= t, same sequence} gamma^(t'-t) r_t' along each row; sequences are contiguous
    segments of a row (seq_ids_BT, or a callable making them, as aggregate takes them). gamma = 0 returns the
    rewards themselves and reads no sequence ids."""
    if gamma == 0.0:
        return rewards_BT.clone()
    seq_ids_BT = seq_ids_BT() if callable(seq_ids_BT) else seq_ids_BT
    T = rewards_BT.shape[1]
    returns_BT = torch.empty_like(rewards_BT)
    running_B = torch.zeros_like(rewards_BT[:, 0])
    for t in range(T - 1, -1, -1):  # T steps of [B] work: cheap next to the model, and only for gamma > 0
        if t < T - 1:
            # A new sequence starts after t: nothing from it flows back into this one.
            running_B = torch.where(seq_ids_BT[:, t] == seq_ids_BT[:, t + 1], running_B, torch.zeros_like(running_B))
        running_B = rewards_BT[:, t] + gamma * running_B
        returns_BT[:, t] = running_B
    return returns_BT


def grpo_advantages(
    rewards_S: torch.Tensor, group_ids_S: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = (R_i - mean_g R) / (std_g R + eps) per sequence [S] (unbiased std; groups of one -> 0)."""
    rewards = rewards_S.double()
    groups, group_of_S = torch.unique(group_ids_S, return_inverse=True)
    G = groups.numel()
    n_G = torch.zeros(G, dtype=rewards.dtype, device=rewards.device).index_add(0, group_of_S, torch.ones_like(rewards))
    mean_G = torch.zeros_like(n_G).index_add(0, group_of_S, rewards) / n_G
    centered_S = rewards - mean_G[group_of_S]
    if not std_normalize:
        return centered_S.to(rewards_S.dtype if rewards_S.is_floating_point() else torch.float32)
    ss_G = torch.zeros_like(n_G).index_add(0, group_of_S, centered_S**2)
    std_G = torch.where(n_G > 1, (ss_G / (n_G - 1).clamp(min=1)).sqrt(), torch.zeros_like(ss_G))
    adv_S = centered_S / (std_G[group_of_S] + eps)
    return adv_S.to(rewards_S.dtype if rewards_S.is_floating_point() else torch.float32)


def policy_gradient_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    policy_loss: str,
    eps_low: float,
    eps_high: float,
):
    """Per-token loss l_t (see module docstring) and, for metrics, the ratio and where the clip bound."""
    # exp of a difference of log-probs: the ratio itself never overflows for reasonable policies, and a
    # wild one is exactly what the clip is for.
    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT)
    unclipped_BT = ratio_BT * advantages_BT
    if policy_loss == "importance_sampling":
        return -unclipped_BT, ratio_BT, torch.zeros_like(ratio_BT, dtype=torch.bool)
    clipped_BT = torch.clamp(ratio_BT, 1.0 - eps_low, 1.0 + eps_high) * advantages_BT
    # The clip binds (and the token's gradient is 0) where the clipped objective is the smaller one.
    clip_active_BT = (clipped_BT < unclipped_BT).detach()
    return -torch.minimum(unclipped_BT, clipped_BT), ratio_BT, clip_active_BT


def _off_policy(
    inputs: LossInputs, loss_BT: torch.Tensor, old_BT: torch.Tensor, mask_BT: torch.Tensor
) -> tuple[torch.Tensor, Metrics]:
    """loss_BT times the off-policy weights of loss.off_policy_correction (tis, mis), with their metrics."""
    w_BT, bound_BT = correction_weights(inputs.off_policy, old_BT, inputs.engine_logprobs_BT)
    if w_BT is None:
        return loss_BT, {}
    return loss_BT * w_BT.to(loss_BT.dtype), correction_metrics(w_BT, bound_BT, mask_BT)


@dataclass
class PolicyTokens:
    """One policy-gradient update's per-token tensors [B, T], as _policy_metrics reports them."""

    logprobs_BT: torch.Tensor
    """log pi_theta of the sampled tokens."""
    old_BT: torch.Tensor
    """log pi_old of the same tokens."""
    advantages_BT: torch.Tensor
    ratio_BT: torch.Tensor
    """pi_theta / pi_old (policy_gradient_loss)."""
    clip_BT: torch.Tensor
    """Where the clip binds (bool; policy_gradient_loss)."""


def _policy_metrics(
    prefix: str,
    inputs: LossInputs,
    tokens: PolicyTokens,
    log_entropy: bool,
    extra_means: dict[str, torch.Tensor] | None = None,
) -> Metrics:
    """The update's metrics under `prefix` (opd, grpo): means over the loss tokens, the ratio's max, the token count."""
    mask_BT, old_BT, ratio_BT = inputs.loss_mask_BT, tokens.old_BT, tokens.ratio_BT
    logprobs_BT = tokens.logprobs_BT.detach()
    adv_BT, clip_BT = tokens.advantages_BT, tokens.clip_BT
    means = {
        f"{prefix}/advantage_mean": adv_BT,
        f"{prefix}/ratio_mean": ratio_BT,
        f"{prefix}/clip_frac": clip_BT.to(logprobs_BT.dtype),
        # k3 estimate of KL(pi_old || pi_theta) on the sampled tokens: how far the update has moved.
        f"{prefix}/approx_kl_old": torch.expm1(logprobs_BT - old_BT) - (logprobs_BT - old_BT),
        f"{prefix}/student_logprob_mean": logprobs_BT,
        **({f"{prefix}/entropy": inputs.student_entropy()} if log_entropy else {}),
        **(extra_means or {}),
    }
    return {
        **masked_means(means, mask_BT),
        f"{prefix}/ratio_max": masked_max(ratio_BT, mask_BT),
        f"{prefix}/num_tokens": mask_BT.detach().sum().to(logprobs_BT.dtype),
    }


@register_loss("opd", OPDConfig, needs=LossNeeds(old_logprobs=True, teacher_logprobs=True))
def opd_loss(inputs: LossInputs, config: OPDConfig) -> tuple[torch.Tensor, Metrics]:
    """Sampled-token OPD. Needs: old_logprobs_BT, teacher_logprobs_BT. Divides by global_num_tokens
    (token-mean) or global_num_seqs (seq-mean-*)."""
    old_BT = inputs.need("old_logprobs_BT", "opd").detach()
    teacher_BT = inputs.need("teacher_logprobs_BT", "opd").detach()
    mask_BT = inputs.loss_mask_BT
    logprobs_BT = inputs.student_logprobs()
    with torch.no_grad():
        # The reward is a constant of the update (the advantage must not carry gradient into pi_theta).
        on_BT = mask_BT.bool()
        baseline_BT = reward_baseline(inputs.off_policy, old_BT, logprobs_BT)  # log pi_old, or recomputed
        spans_BT = inputs.teacher_spans_BT
        if spans_BT is not None:  # a teacher with another tokenizer: span rewards (cross_tokenizer.py)
            on_BT = on_BT & (spans_BT >= 0)
        rewards_BT = torch.where(on_BT, teacher_BT - baseline_BT, torch.zeros_like(teacher_BT)).to(logprobs_BT.dtype)
        if spans_BT is None:
            advantages_BT = config.advantage_scale * discounted_returns(rewards_BT, inputs.seq_ids, config.gamma)
        else:
            seq_ids_BT = inputs.seq_ids()
            placed_BT, end_BT = place_at_span_ends(rewards_BT, spans_BT, seq_ids_BT, on_BT)
            returns_BT = discounted_returns(placed_BT, seq_ids_BT, config.gamma)
            advantages_BT = config.advantage_scale * take_at_span_ends(returns_BT, end_BT)
    loss_BT, ratio_BT, clip_BT = policy_gradient_loss(
        logprobs_BT, old_BT, advantages_BT, config.policy_loss, config.eps_low, config.eps_high
    )
    loss_BT, off_metrics = _off_policy(inputs, loss_BT, old_BT, mask_BT)
    loss = aggregate(
        loss_BT,
        mask_BT,
        inputs.seq_ids,
        inputs.num_seqs,
        config.aggregation,
        inputs.global_num_tokens,
        inputs.global_num_seqs,
    )
    metrics = _policy_metrics(
        "opd",
        inputs,
        PolicyTokens(logprobs_BT, old_BT, advantages_BT, ratio_BT, clip_BT),
        config.log_entropy,
        {
            "opd/reward_mean": rewards_BT,
            "opd/teacher_logprob_mean": teacher_BT,
            # Sampled-token estimate of the reverse KL(pi_old || q) that OPD minimizes: -reward, whose mean in the
            # same stacked sum is exactly -reward_mean (negation commutes with rounding).
            "opd/reverse_kl": -rewards_BT,
        },
    )
    metrics.update(off_metrics)
    if spans_BT is not None:  # loss tokens with no span (special tokens of one side): their advantage is 0
        metrics["opd/unaligned_frac"] = masked_mean((spans_BT < 0).to(logprobs_BT.dtype), mask_BT)
    return loss, metrics


@register_loss("grpo", GRPOConfig, needs=LossNeeds(old_logprobs=True, rewards=True))
def grpo_loss(inputs: LossInputs, config: GRPOConfig) -> tuple[torch.Tensor, Metrics]:
    """GRPO. Needs: old_logprobs_BT, rewards_S, group_ids_S (whole groups in this micro-batch).
    Divides by global_num_tokens (token-mean) or global_num_seqs (seq-mean-*)."""
    old_BT = inputs.need("old_logprobs_BT", "grpo").detach()
    rewards_S = inputs.need("rewards_S", "grpo").detach()
    group_ids_S = inputs.need("group_ids_S", "grpo")
    mask_BT = inputs.loss_mask_BT
    logprobs_BT = inputs.student_logprobs()
    seq_ids_BT = inputs.seq_ids()
    with torch.no_grad():
        adv_S = grpo_advantages(rewards_S, group_ids_S, config.std_normalize, config.eps)
        advantages_BT = adv_S.to(logprobs_BT.dtype)[seq_ids_BT]  # each token gets its response's advantage
    loss_BT, ratio_BT, clip_BT = policy_gradient_loss(
        logprobs_BT, old_BT, advantages_BT, "ppo_clip", config.eps_low, config.eps_high
    )
    loss_BT, off_metrics = _off_policy(inputs, loss_BT, old_BT, mask_BT)  # tis / mis (recompute is opd's)
    loss = aggregate(
        loss_BT,
        mask_BT,
        seq_ids_BT,
        inputs.num_seqs,
        config.aggregation,
        inputs.global_num_tokens,
        inputs.global_num_seqs,
    )
    metrics = _policy_metrics(
        "grpo", inputs, PolicyTokens(logprobs_BT, old_BT, advantages_BT, ratio_BT, clip_BT), config.log_entropy
    )
    metrics.update(off_metrics)
    metrics["grpo/reward_mean"] = rewards_S.float().mean() if rewards_S.numel() else rewards_S.new_zeros(())
    return loss, metrics
