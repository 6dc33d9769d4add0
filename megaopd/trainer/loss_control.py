"""The trainer's loss, with Stable-OPD's adaptive controller when loss.controller=adaptive
(megaopd/losses/controller.py has the rule; docs/algorithms.md 1.11).

    loss_fn = ControlledLoss(cfg.loss)     # called like a BoundLoss: loss, metrics = loss_fn(inputs)
    stateful = {..., **loss_fn.stateful}   # the controller's state in the checkpoint (adaptive only)
    metrics.update(loss_fn.observe(step, step_metrics, run_log))   # every rank, after the step's metrics

With controller=fixed it is the configured loss and observe does nothing, so fixed runs log and
checkpoint exactly what they did before.
"""
from __future__ import annotations

from typing import Mapping

from megaopd.losses import LossConfig, build_controller, build_loss_from
from megaopd.losses.controller import ControllerSignals


def signals_from(metrics: Mapping[str, float]) -> ControllerSignals:
    """The step's early-warning signals from its rollout metrics (trainer/step_metrics.py's names); a run
    without a teacher has no advantage split, so its gap is 0; a step without rollout/reward_mean gives the
    reward signal nothing."""
    reward = metrics.get("rollout/reward_mean")
    return ControllerSignals(truncation_rate=float(metrics.get("rollout/truncation_rate", 0.0)),
                             repetition_rate=float(metrics.get("rollout/repetition_rate", 0.0)),
                             adv_gap=float(metrics.get("adv/repetitive_mean", 0.0) - metrics.get("adv/regular_mean", 0.0)),
                             repetitive_share=float(metrics.get("adv/repetitive_token_share", 0.0)),
                             reward=None if reward is None else float(reward))


class ControlledLoss:
    """The configured loss at the controller's current weights."""

    def __init__(self, section: LossConfig):
        self._base = build_loss_from(section)
        self.controller = build_controller(section, self._base)
        self.name, self.needs = self._base.name, self._base.needs

    def __call__(self, inputs):
        return (self.controller.loss if self.controller is not None else self._base)(inputs)

    @property
    def stateful(self) -> dict:
        """{"loss_controller": controller} for the checkpoint's components; {} when fixed."""
        return {"loss_controller": self.controller} if self.controller is not None else {}

    def observe(self, step: int, metrics: Mapping[str, float], run_log=None) -> dict[str, float]:
        """Feeds the step's rollout metrics to the controller (identical on every rank, so every rank moves
        the same way); logs a `loss_controller` event on a change (run_log: rank 0's, None elsewhere).
        Returns controller/* metrics: the weights this step trained with, and the pressure."""
        if self.controller is None:
            return {}
        used = {"controller/sft_weight": self.controller.state.sft_weight,
                "controller/ref_kl_weight": self.controller.state.ref_kl_weight}
        change = self.controller.observe(step, signals_from(metrics))
        used["controller/pressure"] = self.controller.last_pressure
        if change is not None and run_log is not None:
            run_log.event(step, "loss_controller", change.message, action=change.decision.action,
                          sft_weight=change.after[0], ref_kl_weight=change.after[1],
                          pressure=change.decision.pressure, reason=change.decision.reason)
        return used
