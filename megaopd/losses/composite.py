"""Weighted sums of registered losses, and Stable-OPD as one of them.

weighted_sum:  L = sum_i w_i L_i over config terms [{name, weight, config, label}], each L_i aggregated
               by its own config (so each term divides by its own global count).
stable_opd:    L = L_opd + lambda L_sft + beta KL_ref   (paper 2604.08527 sec. 4; lambda = 0.1 and
               beta = 0.01 are ours: the paper does not print them). A zero weight drops the term, so
               lambda = 0 needs no golden data and beta = 0 no reference model.

Returns a LossResult: the weighted total, each term's unweighted loss under its label (default: its name) in
`terms`, and each term's own metrics re-homed under its label.

    build_loss("weighted_sum", {"terms": [{"name": "opd"}, {"name": "lsm", "weight": 0.5}]})
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megaopd.losses.divergence import RefKLConfig, SFTConfig
from megaopd.losses.inputs import LossInputs
from megaopd.losses.needs import LossNeeds
from megaopd.losses.policy import OPDConfig
from megaopd.losses.registry import BoundLoss, LossResult, Metrics, build_loss, register_loss


@dataclass
class TermConfig:
    """One term of a weighted sum."""

    name: str = ""
    """A registered loss name (opd, grpo, sft, ref_kl, lsm, gkd, ...)."""
    weight: float = 1.0
    """Multiplies the term; 0 drops it (its inputs are then not needed)."""
    config: dict[str, Any] = field(default_factory=dict)
    """That loss's own config section (keys of its config dataclass); empty = its defaults."""
    label: str | None = None
    """Metric namespace of the term; None = name. Must be unique within the sum."""

    def __post_init__(self):
        if not self.name:
            raise ValueError("a weighted_sum term needs a name: one of the registered losses")


@dataclass
class WeightedSumConfig:
    """sum_i weight_i * loss_i."""

    terms: list[TermConfig] = field(default_factory=list)
    """The terms; each a TermConfig or a mapping with its keys."""

    def __post_init__(self):
        self.terms = [t if isinstance(t, TermConfig) else TermConfig(**dict(t)) for t in self.terms]
        if not self.terms:
            raise ValueError("weighted_sum has no terms; give terms: [{name: opd}, ...]")
        labels = [t.label or t.name for t in self.terms]
        if len(set(labels)) != len(labels):
            raise ValueError(f"weighted_sum term labels {labels} repeat; give repeated losses distinct `label`s")
        # Resolve and validate every term's config now, at start-up, not at the first step.
        self._bound = [(t.label or t.name, t.weight, build_loss(t.name, t.config)) for t in self.terms]


def _weighted_sum(inputs: LossInputs, bound: list[tuple[str, float, BoundLoss]]) -> LossResult:
    total = None
    terms: dict[str, torch.Tensor] = {}
    metrics: Metrics = {}
    for label, weight, loss_fn in bound:
        if weight == 0.0:
            continue
        term = loss_fn(inputs)
        for key, value in term.metrics.items():
            # Each loss names its metrics "<name>/..."; re-home them under the term's label.
            metrics[label + key[len(loss_fn.name) :] if key.startswith(loss_fn.name + "/") else key] = value
        terms[label] = term.total.detach()
        total = weight * term.total if total is None else total + weight * term.total
    if total is None:  # every weight is 0: a zero that still connects to the logits for backward()
        total = inputs.zero_loss()
    return LossResult(total, terms, metrics)


def _terms_needs(config: "WeightedSumConfig | StableOPDConfig") -> LossNeeds:
    """A zero-weight term needs nothing (it is dropped)."""
    needs = LossNeeds()
    for _label, weight, term in config._bound:
        if weight != 0.0:
            needs = needs.merge(term.needs)
    return needs


@register_loss("weighted_sum", WeightedSumConfig, needs=_terms_needs)
def weighted_sum_loss(inputs: LossInputs, config: WeightedSumConfig) -> LossResult:
    """sum_i w_i L_i; each term needs its own inputs and divides by its own global count."""
    return _weighted_sum(inputs, config._bound)


@dataclass
class StableOPDConfig:
    """Stable-OPD: OPD + lambda * SFT on golden solutions + beta * KL to the reference."""

    sft_weight: float = 0.1
    """lambda (ours, 0.1; not printed in the paper)."""
    ref_kl_weight: float = 0.01
    """beta (ours, 0.01; not printed in the paper)."""
    opd: OPDConfig = field(default_factory=OPDConfig)
    """The policy term (opd config section)."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """The golden-data term."""
    ref_kl: RefKLConfig = field(default_factory=RefKLConfig)
    """The reference-KL term (default: exact full-vocabulary KL)."""

    def __post_init__(self):
        if self.sft_weight < 0 or self.ref_kl_weight < 0:
            raise ValueError(f"sft_weight={self.sft_weight} and ref_kl_weight={self.ref_kl_weight} must be >= 0")
        self._bound = [
            ("opd", 1.0, build_loss("opd", self.opd)),
            ("sft", self.sft_weight, build_loss("sft", self.sft)),
            ("ref_kl", self.ref_kl_weight, build_loss("ref_kl", self.ref_kl)),
        ]


@register_loss("stable_opd", StableOPDConfig, needs=_terms_needs)
def stable_opd_loss(inputs: LossInputs, config: StableOPDConfig) -> LossResult:
    """L_opd + sft_weight L_sft + ref_kl_weight KL; needs opd's inputs, plus sft's / ref_kl's when weighted."""
    return _weighted_sum(inputs, config._bound)
