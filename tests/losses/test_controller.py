"""Stable-OPD's adaptive controller (megaopd/losses/controller.py) on synthetic metric traces: a rise, a
fall, noise, a plateau; its bounds; and a resume from its checkpointed state continuing the same trajectory."""

import json
import random

import pytest

from megaopd.losses import LossConfig, build_loss
from megaopd.losses.controller import AdaptiveConfig, ControllerSignals, WeightController, build_controlled_loss, slope
from megaopd.trainer.loss_control import ControlledLoss
from megaopd.trainer.step_metrics import RolloutSignals

CFG = AdaptiveConfig()  # sft_weight in [0, 0.3], ref_kl_weight in [0, 0.05]


def run(trace, cfg=CFG, ctl=None, start=0):
    """Weights after each step of a trace of (truncation, repetition[, gap, share]) tuples."""
    ctl = ctl or WeightController(cfg, build_loss("stable_opd", {"sft_weight": 0.0, "ref_kl_weight": 0.0}))
    out = []
    for i, values in enumerate(trace):
        ctl.observe(start + i, ControllerSignals(*values))
        out.append((ctl.state.sft_weight, ctl.state.ref_kl_weight))
    return out, ctl


def test_slope_is_least_squares():
    assert slope((0.0, 0.1, 0.2, 0.3)) == pytest.approx(0.1)
    assert slope((0.5, 0.5, 0.5)) == 0.0 and slope((1.0,)) == 0.0


def test_a_rise_raises_both_weights_to_the_ceiling_within_a_few_steps():
    calm = [(0.0, 0.0)] * 10
    rise = [(0.02 * i, 0.01 * i) for i in range(1, 16)]  # truncation +0.02 / step: the slope leads the level
    weights, _ = run(calm + rise)
    assert weights[9] == (0.0, 0.0)  # calm: nothing moves
    first = next(i for i, w in enumerate(weights) if w[0] > 0)
    assert 10 <= first <= 13  # reacts within a few steps of the rise's start (before truncation reaches 0.1)
    assert weights[first + 3] == pytest.approx((0.3, 0.05))  # floor -> ceiling in 4 raises
    assert max(w[0] for w in weights) == 0.3 and max(w[1] for w in weights) == 0.05  # never past the bounds


def test_after_a_fall_the_weights_come_down_slowly_after_the_cooldown():
    burst = [(0.0, 0.0)] * 5 + [(0.4, 0.2)] * 5  # up to the ceiling
    fall = [(0.0, 0.0)] * 40
    weights, _ = run(burst + fall)
    top = weights[9]
    assert top == pytest.approx((0.3, 0.05))
    after = weights[10:]
    # While the window still sees the drop as a falling trend / remembers the burst, and during the cooldown: held.
    assert all(w == top for w in after[: CFG.cooldown - 1])
    downs = [i for i in range(1, len(after)) if after[i][0] < after[i - 1][0]]
    assert downs, "the weights never came down"
    steps = [after[i - 1][0] - after[i][0] for i in downs]
    assert max(steps) == pytest.approx(CFG.lower_fraction * 0.3)  # slow: 5% of the range per step
    assert after[-1][0] < top[0] and all(b <= a for a, b in zip(after, after[1:]))  # monotone down, no bounce


def test_noise_around_a_healthy_level_moves_nothing():
    rng = random.Random(0)
    trace = [(max(0.0, 0.02 + rng.uniform(-0.015, 0.015)), max(0.0, rng.uniform(-0.01, 0.01))) for _ in range(200)]
    weights, _ = run(trace)
    assert set(weights) == {(0.0, 0.0)}


def test_noise_around_a_raised_level_does_not_oscillate():
    """Started at the ceiling, noisy signals in the dead band hold the weights: no up-down flapping."""
    rng = random.Random(1)
    trace = [(0.07 + rng.uniform(-0.01, 0.01), 0.0) for _ in range(100)]  # truncation 0.06-0.08: pressure 0.6-0.8
    ctl = WeightController(CFG, build_loss("stable_opd", {"sft_weight": 0.3, "ref_kl_weight": 0.05}))
    weights, _ = run(trace, ctl=ctl)
    assert set(weights) == {(0.3, 0.05)}


def test_a_high_plateau_keeps_the_ceiling():
    weights, ctl = run([(0.0, 0.0)] * 5 + [(0.6, 0.4)] * 60)
    assert all(w == pytest.approx((0.3, 0.05)) for w in weights[9:])
    assert ctl.state.calm_steps == 0


def test_the_advantage_gap_alone_raises_only_with_enough_repetitive_tokens():
    few = [(0.0, 0.0, 2.0, 0.01)] * 5  # gap 2 nats but 1% repetitive tokens: not counted
    weights, _ = run(few)
    assert weights[-1] == (0.0, 0.0)
    many = [(0.0, 0.0, 2.0, 0.2)] * 2
    weights, _ = run(many)
    assert weights[0][0] > 0


def rewards(trace, cfg=CFG):
    """Weights after each step of a trace of rewards (no truncation, repetition or gap)."""
    return run([(0.0, 0.0, 0.0, 0.0, r) for r in trace], cfg=cfg)


def test_a_falling_reward_raises_the_weights():
    """The accuracy study's failure: the rollouts' reward falls (0.30 -> 0.10 over 10 steps) with no truncation
    or repetition at all. The peak is the early mean; the last 3 steps' mean falls 0.05 below it by step 6."""
    trace = [0.30, 0.31, 0.29] + [0.29 - 0.02 * i for i in range(1, 11)] + [0.10] * 5
    weights, _ = rewards(trace)
    first = next(i for i, w in enumerate(weights) if w[0] > 0)
    assert 4 <= first <= 6
    assert weights[first + 3] == pytest.approx((0.3, 0.05))
    ctl = WeightController(CFG, build_loss("stable_opd", {"sft_weight": 0.0, "ref_kl_weight": 0.0}))
    changes = [ctl.observe(i, ControllerSignals(0.0, 0.0, reward=r)) for i, r in enumerate(trace[: first + 1])]
    assert changes[first] is not None and changes[first].decision.reason.startswith("reward_drop=")


def test_a_rising_or_noisy_reward_moves_nothing():
    rng = random.Random(3)
    rise = [min(1.0, 0.2 + 0.01 * i + rng.uniform(-0.02, 0.02)) for i in range(60)]
    assert set(rewards(rise)[0]) == {(0.0, 0.0)}
    noise = [0.3 + rng.uniform(-0.03, 0.03) for _ in range(200)]  # +-0.03 per step around a level
    assert set(rewards(noise)[0]) == {(0.0, 0.0)}
    # reward_drop=0 turns the signal off; a step without a reward (None) leaves it untouched.
    fall = [0.5] * 5 + [0.0] * 10
    assert set(rewards(fall, cfg=AdaptiveConfig(reward_drop=0.0))[0]) == {(0.0, 0.0)}
    assert set(run([(0.0, 0.0)] * 20)[0]) == {(0.0, 0.0)}
    assert rewards(fall)[0][-1][0] > 0


def test_bounds_floors_and_start_values():
    cfg = AdaptiveConfig(sft_weight_min=0.05, sft_weight_max=0.2, ref_kl_weight_min=0.01, ref_kl_weight_max=0.01)
    ctl = WeightController(cfg, build_loss("stable_opd", {"sft_weight": 0.5, "ref_kl_weight": 0.0}))
    assert (ctl.state.sft_weight, ctl.state.ref_kl_weight) == (0.2, 0.01)  # clamped into the bounds
    weights, _ = run([(0.0, 0.0)] * 200, cfg=cfg, ctl=ctl)
    assert weights[-1] == pytest.approx((0.05, 0.01))  # down to the floors, not below
    assert ctl.loss.config.sft_weight == pytest.approx(0.05)  # the loss is bound at the current weights
    with pytest.raises(ValueError, match="sft_weight_min"):
        AdaptiveConfig(sft_weight_min=0.3, sft_weight_max=0.1)
    with pytest.raises(ValueError, match="controller=adaptive"):
        build_controlled_loss("opd", {}, "adaptive", AdaptiveConfig())
    with pytest.raises(ValueError, match="fixed, adaptive"):
        build_controlled_loss("stable_opd", {}, "pid", AdaptiveConfig())


def test_needs_are_those_at_the_ceilings():
    """Starting at lambda = beta = 0 still loads golden data and the reference, so a raise has them."""
    loss = ControlledLoss(
        LossConfig(name="stable_opd", config={"sft_weight": 0.0, "ref_kl_weight": 0.0}, controller="adaptive")
    )
    assert loss.needs.golden and loss.needs.reference
    fixed = ControlledLoss(LossConfig(name="stable_opd", config={"sft_weight": 0.0, "ref_kl_weight": 0.0}))
    assert not fixed.needs.golden and not fixed.needs.reference
    assert (
        fixed.stateful == {}
        and fixed.observe(1, RolloutSignals(truncation_rate=1.0, repetition_rate=0.0, reward_mean=0.0)) == {}
    )


def test_resume_from_a_checkpoint_continues_the_same_trajectory():
    rng = random.Random(2)
    trace = (
        [(0.0, 0.0)] * 5
        + [(min(1.0, 0.03 * i + rng.uniform(0, 0.05)), 0.0) for i in range(20)]
        + [(rng.uniform(0, 0.02), 0.0) for _ in range(40)]
    )
    # with rewards: the window and its peak are part of what a resume must carry (a fall after the cut)
    trace = [(t, r, 0.0, 0.0, 0.4 if i < 20 else 0.2) for i, (t, r) in enumerate(trace)]
    straight, _ = run(trace)
    first, ctl = run(trace[:17])
    saved = json.loads(json.dumps(ctl.state_dict()))  # through JSON, as trainer_state.json keeps it
    resumed = WeightController(CFG, build_loss("stable_opd", {"sft_weight": 0.0, "ref_kl_weight": 0.0}))
    resumed.load_state_dict(saved)
    second, _ = run(trace[17:], ctl=resumed, start=17)
    assert first + second == straight
    assert len(set(straight)) > 3  # the trace exercises raises and lowerings


def test_trainer_side_logs_every_change_as_an_event():
    class Log:
        def __init__(self):
            self.events = []

        def event(self, step, name, message, loud=False, **fields):
            self.events.append((step, name, message, fields))

    loss = ControlledLoss(LossConfig(name="stable_opd", config={"sft_weight": 0.0}, controller="adaptive"))
    log, changes = Log(), 0
    for step, t in enumerate([0.0] * 3 + [0.5] * 6 + [0.0] * 30, start=1):
        before = loss.controller.state.sft_weight
        m = loss.observe(step, RolloutSignals(truncation_rate=t, repetition_rate=0.0, reward_mean=0.0), log)
        assert m["controller/sft_weight"] == before  # the weight this step trained with
        changes += loss.controller.state.sft_weight != before
    assert len(log.events) == changes > 0
    assert all(e[1] == "loss_controller" and "sft_weight" in e[2] for e in log.events)
    assert loss.stateful == {"loss_controller": loss.controller}
