"""The loss registry: name -> (function, config dataclass).

A loss is `fn(inputs: LossInputs, config: ItsConfig) -> (loss, metrics)`: loss a 0-dim tensor (this
micro-batch's share of the step loss, see aggregation.py), metrics a dict of detached 0-dim tensors
named "<loss>/<what>" (local micro-batch values; the trainer averages them over micro-batches and ranks).
Each loss declares, where it is registered, what it needs from the trainer (LossNeeds, needs.py: a constant or
a function of its config), so the step computes only that and a new loss is written in one place.

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
from megaopd.losses.needs import LossNeeds

Metrics = dict[str, torch.Tensor]
LossFn = Callable[[LossInputs, Any], tuple[torch.Tensor, Metrics]]


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
