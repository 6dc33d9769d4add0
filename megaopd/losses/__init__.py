"""megaopd.losses: every training objective, one registry by name.

    from megaopd.losses import LossInputs, build_loss
    loss_fn = build_loss("stable_opd", {"sft_weight": 0.1, "ref_kl_weight": 0.01})
    result = loss_fn(LossInputs(logits_BTv=..., token_ids_BT=..., loss_mask_BT=..., ...))
    result.total.backward()    # result.terms: label -> unweighted term; result.metrics: "<label>/<what>"

Registered: opd, grpo (policy.py); sft, ref_kl, lsm, gkd (divergence.py); stable_opd, weighted_sum
(composite.py). Under a teacher with another tokenizer opd and stable_opd take span rewards and
check_cross_tokenizer refuses the full-distribution losses (cross_tokenizer.py). Each loss is a pure
function of a LossInputs record (inputs.py) and its own config dataclass, returns (loss, metrics) with
metrics named "<loss>/<what>" (its BoundLoss makes the LossResult: registry.py), and divides its token sum
by the global count the caller passes (aggregation.py). What a loss reads beyond its logits is declared once,
by the LossNeeds field that asks for it (needs.py). Special-token masking: masking.py. Formulas and
defaults: docs in each module and docs/algorithms.md.
"""

from dataclasses import dataclass, field
from typing import Any

from megaopd.losses.aggregation import AGGREGATIONS, aggregate
from megaopd.losses.composite import StableOPDConfig, TermConfig, WeightedSumConfig
from megaopd.losses.controller import (
    AdaptiveConfig,
    ControllerSignals,
    ControllerState,
    WeightController,
    build_controlled_loss,
    control_step,
)
from megaopd.losses.cross_tokenizer import check_cross_tokenizer
from megaopd.losses.divergence import GKDConfig, LSMConfig, RefKLConfig, SFTConfig, student_topk_support
from megaopd.losses.inputs import LossInputs, all_reduce_counts, local_counts
from megaopd.losses.masking import mask_first_occurrences
from megaopd.losses.needs import LOSS_INPUTS, LossInput, LossNeeds, Source, loss_input
from megaopd.losses.off_policy import OFF_POLICY_CORRECTIONS, OffPolicyCorrection
from megaopd.losses.policy import GRPOConfig, OPDConfig, discounted_returns, grpo_advantages  # registers
from megaopd.losses.registry import LOSSES, BoundLoss, LossResult, build_loss, get_spec, make_config, register_loss


@dataclass
class LossConfig:
    """The job config's `loss` section."""

    name: str = "stable_opd"
    """A registered loss: opd | grpo | sft | ref_kl | lsm | gkd | stable_opd | weighted_sum."""
    config: dict[str, Any] = field(default_factory=dict)
    """That loss's config keys (e.g. {sft_weight: 0.1, opd: {eps_high: 0.28}}); empty = its defaults.
    Checked by `build_loss` at start-up: an unknown key is an error listing the accepted ones."""
    mask_first_tokens: list[str] = field(default_factory=list)
    """Special-token masking (LSM paper): tokens whose FIRST occurrence in each response is removed from
    the loss mask, e.g. ["<think>", "<|im_end|>"] (paper code: "<", "think", "<|im_end|>")."""
    controller: str = "fixed"
    """fixed | adaptive. adaptive (stable_opd only): sft_weight and ref_kl_weight move within the bounds of
    `adaptive` in response to the collapse early-warning signals (controller.py, docs/algorithms.md 1.11);
    they start at the loss config's values, clamped into the bounds."""
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    """The adaptive controller's bounds and rule (read only when controller=adaptive)."""
    off_policy_correction: str = "auto"
    """auto | none | tis | mis | recompute: how opd / grpo treat samples the engine drew under older weights
    (rollout.mode one_step_off / async; losses/off_policy.py, docs/algorithms.md 1.12). auto, resolved when
    the config loads: tis where rollouts lag (one_step_off, async) and the loss has a policy term, else none
    (measured: async at lag 2 kept sync's accuracy with tis, lost 8 points without)."""
    off_policy_clip: float = 2.0
    """C of the correction: tis truncates pi_old / pi_engine at C, mis drops tokens outside [1/C, C]."""


def resolve_correction(section: LossConfig, lagged: bool) -> str:
    """loss.off_policy_correction with auto resolved: tis when rollouts lag the trained weights (`lagged`:
    rollout.mode one_step_off / async) and the loss has a policy term to weight (opd, stable_opd, grpo),
    else none. Other values are kept."""
    if section.off_policy_correction != "auto":
        return section.off_policy_correction
    if not lagged:
        return "none"
    bound = build_controlled_loss(section.name, section.config, section.controller, section.adaptive)[0]
    return "tis" if bound.needs.old_logprobs else "none"


def build_loss_from(section: LossConfig) -> BoundLoss:
    """build_loss(section.name, section.config), with controller=adaptive's needs those at the ceilings and
    loss.off_policy_correction bound to its policy terms (auto, unresolved outside a job config: none)."""
    bound = build_controlled_loss(section.name, section.config, section.controller, section.adaptive)[0]
    method = "none" if section.off_policy_correction == "auto" else section.off_policy_correction
    correction = OffPolicyCorrection(method, section.off_policy_clip)
    if correction.method == "none":
        return bound
    wanted = bound.needs.old_logprobs and (correction.method != "recompute" or bound.needs.teacher_logprobs)
    if not wanted:
        raise ValueError(
            f"loss.off_policy_correction={correction.method} corrects "
            f"{'the reverse-KL reward of opd' if correction.method == 'recompute' else 'opd or grpo'}, "
            f"and loss {section.name!r} has no such term; use loss.off_policy_correction=none"
        )
    bound.off_policy = correction
    bound.needs = bound.needs.merge(LossNeeds(engine_logprobs=correction.weighs))
    return bound


def build_controller(section: LossConfig, loss: BoundLoss) -> WeightController | None:
    """The adaptive controller of `loss` (build_loss_from's), or None for controller=fixed."""
    return WeightController(section.adaptive, loss) if section.controller == "adaptive" else None


__all__ = [
    "AGGREGATIONS",
    "LOSSES",
    "LOSS_INPUTS",
    "OFF_POLICY_CORRECTIONS",
    "AdaptiveConfig",
    "BoundLoss",
    "LossResult",
    "ControllerSignals",
    "ControllerState",
    "OffPolicyCorrection",
    "WeightController",
    "build_controller",
    "control_step",
    "LossInput",
    "LossNeeds",
    "Source",
    "GKDConfig",
    "GRPOConfig",
    "LSMConfig",
    "LossConfig",
    "LossInputs",
    "OPDConfig",
    "RefKLConfig",
    "SFTConfig",
    "StableOPDConfig",
    "TermConfig",
    "WeightedSumConfig",
    "aggregate",
    "all_reduce_counts",
    "build_loss",
    "build_loss_from",
    "check_cross_tokenizer",
    "discounted_returns",
    "get_spec",
    "grpo_advantages",
    "local_counts",
    "loss_input",
    "make_config",
    "mask_first_occurrences",
    "register_loss",
    "student_topk_support",
]
