"""The trainer's loss, with Stable-OPD's adaptive controller when loss.controller=adaptive
(megaopd/losses/controller.py has the rule; docs/algorithms.md 1.11).

    loss_fn = ControlledLoss(cfg.loss)     # called like a BoundLoss: result = loss_fn(inputs), a LossResult
    stateful = {..., **loss_fn.stateful}   # the controller's state in the checkpoint (adaptive only)
    metrics.update(loss_fn.observe(step, signals, run_log))   # every rank, after the step's rollout metrics

With controller=fixed it is the configured loss and observe does nothing, so fixed runs log and
checkpoint exactly what they did before.
"""

from __future__ import annotations

from megaopd.losses import LossConfig, LossResult, build_controller, build_loss_from
from megaopd.losses.controller import ControllerSignals
from megaopd.trainer.step_metrics import RolloutSignals


def controller_signals(signals: RolloutSignals) -> ControllerSignals:
    """The controller's view of a step's rollouts: without a teacher there is no advantage split, so the
    gap and the repetitive share are 0."""
    gap = 0.0 if signals.adv_regular_mean is None else signals.adv_repetitive_mean - signals.adv_regular_mean
    return ControllerSignals(
        truncation_rate=signals.truncation_rate,
        repetition_rate=signals.repetition_rate,
        adv_gap=gap,
        repetitive_share=signals.repetitive_token_share or 0.0,
        reward=signals.reward_mean,
    )


class ControlledLoss:
    """The configured loss at the controller's current weights."""

    def __init__(self, section: LossConfig):
        self._base = build_loss_from(section)
        self.controller = build_controller(section, self._base)
        self.name, self.needs = self._base.name, self._base.needs

    def __call__(self, inputs) -> LossResult:
        """The bound loss's record, at the controller's weights now."""
        return (self.controller.loss if self.controller is not None else self._base)(inputs)

    @property
    def stateful(self) -> dict:
        """{"loss_controller": controller} for the checkpoint's components; {} when fixed."""
        return {"loss_controller": self.controller} if self.controller is not None else {}

    def observe(self, step: int, signals: RolloutSignals, run_log=None) -> dict[str, float]:
        """Feeds the step's rollout signals to the controller (identical on every rank, so every rank moves
        the same way); logs a `loss_controller` event on a change (run_log: rank 0's, None elsewhere).
        Returns controller/* metrics: the weights this step trained with, and the pressure."""
        if self.controller is None:
            return {}
        used = {
            "controller/sft_weight": self.controller.state.sft_weight,
            "controller/ref_kl_weight": self.controller.state.ref_kl_weight,
        }
        change = self.controller.observe(step, controller_signals(signals))
        used["controller/pressure"] = self.controller.last_pressure
        if change is not None and run_log is not None:
            run_log.event(
                step,
                "loss_controller",
                change.message,
                action=change.decision.action,
                sft_weight=change.after[0],
                ref_kl_weight=change.after[1],
                pressure=change.decision.pressure,
                reason=change.decision.reason,
            )
        return used
