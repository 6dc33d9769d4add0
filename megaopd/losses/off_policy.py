"""Corrections for samples drawn under older weights than the ones that train on them (rollout.mode
one_step_off / async; loss.off_policy_correction).

Per response token t, with log pi_old the actor's log-prob of the sampled token (scored when the trainer
takes the batch, so under the weights about to be updated) and log pi_engine the engine's (the weights that
sampled it, up to rollout.max_staleness versions older):
    none       w_t = 1
    tis        w_t = min(pi_old / pi_engine, C)                    truncated importance weight (slime --use-tis)
    mis        w_t = 1 if pi_old / pi_engine in [1/C, C] else 0     masked: tokens too far off-policy leave the loss
    recompute  w_t = 1, and the reverse-KL reward r_t = log q - sg(log pi_theta) takes the student of the
               training forward instead of log pi_old (AsyncOPD, arXiv 2606.24143: the OPD-specific fix)
The weights are constants of the update (no gradient) and multiply the policy-gradient loss l_t
(policy.py) before aggregation. Ratios are taken in log space: min(ratio, C) = exp(min(log ratio, log C))
never overflows, however far the engine's weights lag.

    w_BT, off_BT = correction_weights(OffPolicyCorrection("tis", 2.0), old_BT, engine_BT)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megaopd.losses.aggregation import masked_max

OFF_POLICY_CORRECTIONS = ("none", "tis", "mis", "recompute")


@dataclass(frozen=True)
class OffPolicyCorrection:
    """loss.off_policy_correction and loss.off_policy_clip, resolved."""

    method: str = "none"
    clip: float = 2.0
    """C: the truncation of tis, the band [1/C, C] of mis."""

    def __post_init__(self):
        if self.method not in OFF_POLICY_CORRECTIONS:
            raise ValueError(
                f"loss.off_policy_correction={self.method!r}: choose one of {', '.join(OFF_POLICY_CORRECTIONS)}"
            )
        if not self.clip >= 1.0:
            raise ValueError(f"loss.off_policy_clip={self.clip} must be >= 1 (tis truncates at C, mis keeps [1/C, C])")

    @property
    def weighs(self) -> bool:
        """Per-token weights from the engine's log-probs (tis, mis)."""
        return self.method in ("tis", "mis")


def tis_weights(old_BT: torch.Tensor, engine_BT: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """min(pi_old / pi_engine, C) per token, and where the truncation bound (ratio > C)."""
    log_ratio_BT = (old_BT - engine_BT).detach()
    return torch.exp(torch.clamp(log_ratio_BT, max=math.log(clip))), log_ratio_BT > math.log(clip)


def mis_weights(old_BT: torch.Tensor, engine_BT: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """1 where pi_old / pi_engine lies in [1/C, C], else 0; and where it left the band."""
    log_ratio_BT = (old_BT - engine_BT).detach()
    outside_BT = log_ratio_BT.abs() > math.log(clip)
    return (~outside_BT).to(old_BT.dtype), outside_BT


def correction_weights(
    correction: OffPolicyCorrection | None, old_BT: torch.Tensor, engine_BT: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(w_BT, bound_BT) of a weighing correction; (None, None) for none and recompute."""
    if correction is None or not correction.weighs:
        return None, None
    if engine_BT is None:
        raise ValueError(
            f"loss.off_policy_correction={correction.method} needs LossInputs.engine_logprobs_BT "
            "(the rollout's engine log-probs); the trainer passes them when the correction is set"
        )
    fn = tis_weights if correction.method == "tis" else mis_weights
    return fn(old_BT, engine_BT.to(old_BT.dtype), correction.clip)


def reward_baseline(
    correction: OffPolicyCorrection | None, old_BT: torch.Tensor, logprobs_BT: torch.Tensor
) -> torch.Tensor:
    """The student log-prob the reverse-KL reward subtracts: log pi_old, or (recompute) the training
    forward's own, detached (the reward is a constant of the update)."""
    if correction is not None and correction.method == "recompute":
        return logprobs_BT.detach()
    return old_BT


def correction_metrics(w_BT: torch.Tensor, bound_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """off_policy/weight_mean, /weight_max and /clip_frac (tis: truncated; mis: masked) over the loss mask."""
    m = mask_BT.bool()
    n = m.sum().clamp(min=1).to(w_BT.dtype)
    w = w_BT.detach()
    return {
        "off_policy/weight_mean": (w * m).sum() / n,
        "off_policy/weight_max": masked_max(w, m),  # no host sync per micro-batch
        "off_policy/clip_frac": (bound_BT & m).sum().to(w.dtype) / n,
    }
