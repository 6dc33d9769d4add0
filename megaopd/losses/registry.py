"""The loss registry: name -> (function, config dataclass).

A loss is `fn(inputs: LossInputs, config: ItsConfig) -> (loss, metrics)`: loss a 0-dim tensor (this
micro-batch's share of the step loss, see aggregation.py), metrics a dict of detached 0-dim tensors
named "<loss>/<what>" (local micro-batch values; the trainer averages them over micro-batches and ranks).

    loss_fn = build_loss("stable_opd", {"sft_weight": 0.1})
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
class LossSpec:
    name: str
    fn: LossFn
    config_cls: type


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, config_cls: type):
    """Decorator: registers fn under `name` with its config dataclass."""

    def wrap(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is registered twice ({LOSSES[name].fn.__module__} and {fn.__module__})")
        LOSSES[name] = LossSpec(name, fn, config_cls)
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

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, Metrics]:
        return self.fn(inputs, self.config)


def build_loss(name: str, config: Any = None) -> BoundLoss:
    """The loss `name` with its config resolved (and validated) now, at start-up."""
    spec = get_spec(name)
    return BoundLoss(name, spec.fn, make_config(spec.config_cls, config))
