"""The loss registry: name -> (function, config dataclass).

A loss is `fn(inputs: LossInputs, config: ItsConfig) -> (loss, metrics)`: loss a 0-dim tensor (this
micro-batch's share of the step loss, see aggregation.py), metrics a dict of detached 0-dim tensors
named "<loss>/<what>" (local micro-batch values; the trainer averages them over micro-batches and ranks).
Its BoundLoss returns a LossResult: the total, the terms (a single loss: one, under its registered name) and
the metrics. A loss made of terms (composite.py) returns the LossResult itself, its terms filled.
Each loss declares, where it is registered, what it needs from the trainer (LossNeeds, needs.py: a constant or
a function of its config), so the step computes only that and a new loss is written in one place.

    loss_fn = build_loss("stable_opd", {"sft_weight": 0.1})
    loss_fn.needs.reference    # True: run the reference model in lockstep with the actor
    result = loss_fn(inputs)   # LossResult: result.total (backward), result.terms, result.metrics
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from megaopd.losses.inputs import LossInputs
from megaopd.losses.needs import LossNeeds

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LossResult:
    """What a bound loss returns for one micro-batch. The trainer logs total and terms as loss/total and
    loss/<label>, summed over the step's micro-batches and ranks (each is already a share of the step's global
    count), and the metrics under their own names, averaged; those names are made where the log row is."""

    total: torch.Tensor
    """0-dim: this micro-batch's share of the step loss, the tensor backward() runs on."""
    terms: dict[str, torch.Tensor]
    """label -> the term's unweighted share, detached (a single loss: its registered name -> its total)."""
    metrics: Metrics
    """The losses' own metrics, "<label>/<what>": detached local micro-batch values."""

    def detached(self) -> "LossResult":
        """Every value detached and float32: what the trainer keeps of a micro-batch after its backward."""
        return LossResult(
            self.total.detach().float(),
            {k: v.detach().float() for k, v in self.terms.items()},
            {k: v.detach().float() for k, v in self.metrics.items()},
        )


LossFn = Callable[[LossInputs, Any], "tuple[torch.Tensor, Metrics] | LossResult"]


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
    """A registered loss with its resolved config: `result = bound(inputs)` (a LossResult)."""

    name: str
    fn: LossFn
    config: Any
    needs: LossNeeds
    """What this loss, at this config, reads from the trainer."""
    off_policy: Any = None
    """loss.off_policy_correction (an OffPolicyCorrection) handed to the policy terms; None = none."""

    def __call__(self, inputs: LossInputs) -> LossResult:
        if self.off_policy is not None:
            inputs.off_policy = self.off_policy  # the terms of a sum read it from the one inputs record
        out = self.fn(inputs, self.config)
        if isinstance(out, LossResult):  # a loss made of terms names them itself
            return out
        loss, metrics = out  # a single loss is the total and its one term
        return LossResult(loss, {self.name: loss.detach()}, metrics)


def build_loss(name: str, config: Any = None) -> BoundLoss:
    """The loss `name` with its config resolved (and validated) now, at start-up."""
    spec = get_spec(name)
    config = make_config(spec.config_cls, config)
    needs = spec.needs(config) if callable(spec.needs) else spec.needs
    return BoundLoss(name, spec.fn, config, needs)
