"""The loss registry: name -> (function, config dataclass).

A loss is `fn(inputs: LossInputs, config: ItsConfig) -> (loss, metrics)`: loss a 0-dim tensor (this
micro-batch's share of the step loss, see aggregation.py), metrics a dict of detached 0-dim tensors
named "<loss>/<what>" (local micro-batch values; the trainer averages them over micro-batches and ranks).
Each loss declares, where it is registered, what it needs from the trainer (LossNeeds, a constant or a
function of its config), so the step computes only that and a new loss is written in one place.

    loss_fn = build_loss("stable_opd", {"sft_weight": 0.1})
    loss_fn.needs.reference    # True: run the reference model in lockstep with the actor
    loss, metrics = loss_fn(inputs)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from megaopd.losses.inputs import LossInputs

Metrics = dict[str, torch.Tensor]
LossFn = Callable[[LossInputs, Any], tuple[torch.Tensor, Metrics]]


@dataclass(frozen=True)
class LossNeeds:
    """What a loss reads from the trainer beyond the student's logits and the sampled tokens."""

    old_logprobs: bool = False
    """log pi_old of the sampled tokens (policy ratios: opd, grpo)."""
    teacher_logprobs: bool = False
    """log q of the sampled tokens (opd rewards)."""
    teacher_topk: int = 0
    """Teacher's top-K ids + log-probs per position (lsm, teacher support); 0 = not needed."""
    student_topk: int = 0
    """Student's top-k ids per position, with the teacher's log-probs at them (lsm, student support)."""
    teacher_logits: bool = False
    """The teacher's full logits in the student's sharding (gkd): teacher run in lockstep with the actor."""
    reference: bool = False
    """The reference model's logits in lockstep with the actor (ref_kl)."""
    golden: bool = False
    """Golden solutions in the micro-batches (sft)."""
    rewards: bool = False
    """Verifiable rewards per response (grpo)."""
    engine_logprobs: bool = False
    """The engine's log-probs of the sampled tokens (loss.off_policy_correction tis / mis)."""

    @property
    def teacher(self) -> bool:
        """The loss reads the teacher model."""
        return self.teacher_logprobs or bool(self.teacher_topk) or bool(self.student_topk) or self.teacher_logits

    @property
    def on_policy(self) -> bool:
        """The loss needs rollouts (everything but SFT on golden data alone)."""
        return self.old_logprobs or self.teacher or self.reference or self.rewards

    def merge(self, other: "LossNeeds") -> "LossNeeds":
        """What two losses summed need: the union (the larger top-k)."""
        return LossNeeds(
            **{
                f.name: max(getattr(self, f.name), getattr(other, f.name))  # or, for bools
                for f in dataclasses.fields(self)
            }
        )


NeedsDecl = LossNeeds | Callable[[Any], LossNeeds]
"""A loss's needs: a constant, or a function of its resolved config (lsm: which support, which k)."""


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: LossFn
    config_cls: type
    needs: NeedsDecl


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, config_cls: type, needs: NeedsDecl):
    """Decorator: registers fn under `name` with its config dataclass and what it needs."""

    def wrap(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is registered twice ({LOSSES[name].fn.__module__} and {fn.__module__})")
        LOSSES[name] = LossSpec(name, fn, config_cls, needs)
        return fn

    return wrap


def get_spec(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; registered losses: {', '.join(sorted(LOSSES))}")
    return LOSSES[name]


def make_config(config_cls: type, values: Any = None):
    """A config_cls instance from None (defaults), an instance, or a mapping (dict / omegaconf DictConfig);
    nested dataclass fields accept mappings too. Unknown keys raise ValueError listing the accepted ones."""
    if values is None:
        return config_cls()
    if isinstance(values, config_cls):
        return values
    if not isinstance(values, Mapping):
        try:
            from omegaconf import OmegaConf

            if OmegaConf.is_config(values):
                values = OmegaConf.to_container(values, resolve=True)
        except ImportError:  # pragma: no cover - omegaconf is a dependency
            pass
    if dataclasses.is_dataclass(values):
        values = dataclasses.asdict(values)
    if not isinstance(values, Mapping):
        raise ValueError(f"config for {config_cls.__name__} must be a mapping, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} for {config_cls.__name__}; accepted: {', '.join(fields)}")
    kwargs = {}
    for key, value in values.items():
        nested = _dataclass_type(config_cls, key)
        kwargs[key] = make_config(nested, value) if nested is not None and value is not None else value
    return config_cls(**kwargs)


def _dataclass_type(config_cls: type, key: str):
    import typing

    hint = typing.get_type_hints(config_cls).get(key)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


@dataclass
class BoundLoss:
    """A registered loss with its resolved config: `loss, metrics = bound(inputs)`."""

    name: str
    fn: LossFn
    config: Any
    needs: LossNeeds
    """What this loss, at this config, reads from the trainer."""
    off_policy: Any = None
    """loss.off_policy_correction (an OffPolicyCorrection) handed to the policy terms; None = none."""

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, Metrics]:
        if self.off_policy is not None:
            inputs.off_policy = self.off_policy  # the terms of a sum read it from the one inputs record
        return self.fn(inputs, self.config)


def build_loss(name: str, config: Any = None) -> BoundLoss:
    """The loss `name` with its config resolved (and validated) now, at start-up."""
    spec = get_spec(name)
    config = make_config(spec.config_cls, config)
    needs = spec.needs(config) if callable(spec.needs) else spec.needs
    return BoundLoss(name, spec.fn, config, needs)
