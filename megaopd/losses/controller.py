"""Stable-OPD's adaptive controller (`loss.controller: adaptive`): the golden-mix weight (sft_weight) and the
reference-KL coefficient (ref_kl_weight) follow the collapse early-warning signals of the rollouts, within
configured bounds (docs/algorithms.md 1.11).

Each step the trainer passes the step's signals (ControllerSignals: truncation and repetition rates, the
repetitive-vs-regular advantage gap); `control_step` is a pure function of (state, signals, config) that
returns the next state and what it decided:

    pressure = max of   slope(truncation over the window) / truncation_slope
                        slope(repetition over the window) / repetition_slope
                        truncation now / truncation_level,   repetition now / repetition_level
                        (adv gap) / gap            (only when repetitive tokens are >= gap_min_share)
                        (reward peak - reward now) / reward_drop   (the rollouts' math-verify reward: the
                                                   best `window`-step mean so far minus the last
                                                   `min_history` steps' mean; 0 turns it off)
    pressure >= 1               raise: both weights up by raise_fraction of their ranges (to the ceiling)
    pressure < calm_fraction    a calm step; after `cooldown` calm steps in a row, both weights down by
                                lower_fraction of their ranges per step (to the floor)
    in between                  hold (and the calm count starts again)

What stops it oscillating: the dead band between calm_fraction and 1, the cooldown, rates fitted over a
window (one noisy step barely moves a least-squares slope), and raising faster than lowering.

WeightController is the trainer's stateful wrapper (state_dict / load_state_dict for the checkpoint; the
state is plain floats and lists, so a resumed run continues the same trajectory), and hands out the loss
bound at the current weights.

    ctl = WeightController(AdaptiveConfig(), build_loss("stable_opd", {"sft_weight": 0.0}))
    change = ctl.observe(step, ControllerSignals(truncation_rate=0.1, repetition_rate=0.0, adv_gap=0.0))
    loss_fn = ctl.loss          # stable_opd at the weights now
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megaopd.losses.registry import BoundLoss, build_loss

CONTROLLERS = ("fixed", "adaptive")


@dataclass
class AdaptiveConfig:
    """The job config's `loss.adaptive` section (read when loss.controller=adaptive). Defaults: ours."""

    sft_weight_min: float = 0.0
    """Floor of the golden-mix weight lambda (0: no golden tokens are trained on while the run is calm)."""
    sft_weight_max: float = 0.3
    """Ceiling of lambda."""
    ref_kl_weight_min: float = 0.0
    """Floor of the reference-KL coefficient beta."""
    ref_kl_weight_max: float = 0.05
    """Ceiling of beta."""
    window: int = 8
    """Steps of the rates' least-squares trend."""
    min_history: int = 3
    """Values needed before a trend counts."""
    truncation_slope: float = 0.01
    """Truncation-rate rise per step that is full pressure (0.01: +0.08 over an 8-step window)."""
    repetition_slope: float = 0.01
    """Repetition-rate rise per step that is full pressure."""
    truncation_level: float = 0.1
    """Truncation rate that is full pressure by itself, whatever its trend."""
    repetition_level: float = 0.05
    """Repetition rate that is full pressure by itself."""
    gap: float = 0.5
    """adv/repetitive_mean - adv/regular_mean (nats per token) that is full pressure: the reverse-KL reward
    favouring repeated n-grams, the collapse's mechanism (paper 2604.08527 fig. 4)."""
    gap_min_share: float = 0.05
    """The gap counts only when repetitive tokens are at least this share of the step's tokens."""
    reward_drop: float = 0.05
    """Fall of the rollouts' reward (rollout/reward_mean, the share of samples math-verify accepts) that is full
    pressure: the best mean over `window` steps so far minus the mean of the last `min_history` steps. A
    student whose updates are too large loses accuracy before (or without) any truncation or repetition
    (examples/tiny/README.md, "The accuracy study"). 0 turns the signal off (tasks without a reward)."""
    raise_fraction: float = 0.25
    """A raise moves each weight by this fraction of its range (0.25: floor to ceiling in 4 steps)."""
    lower_fraction: float = 0.05
    """A lowering step moves each weight by this fraction of its range (ceiling to floor in 20 steps)."""
    calm_fraction: float = 0.5
    """A step is calm when its pressure is below this (the dead band [calm_fraction, 1) holds)."""
    cooldown: int = 5
    """Calm steps in a row before the weights come down."""

    def __post_init__(self):
        for name in ("sft_weight", "ref_kl_weight"):
            lo, hi = getattr(self, f"{name}_min"), getattr(self, f"{name}_max")
            if not 0 <= lo <= hi:
                raise ValueError(f"loss.adaptive.{name}_min={lo} and {name}_max={hi} must satisfy 0 <= min <= max")
        if not 1 <= self.min_history <= self.window:
            raise ValueError(f"loss.adaptive.min_history={self.min_history} must be in [1, window={self.window}]")
        for name in ("truncation_slope", "repetition_slope", "truncation_level", "repetition_level", "gap"):
            if getattr(self, name) <= 0:
                raise ValueError(f"loss.adaptive.{name}={getattr(self, name)} must be > 0")
        if self.reward_drop < 0:
            raise ValueError(f"loss.adaptive.reward_drop={self.reward_drop} must be >= 0 (0 turns the signal off)")
        if not (0 < self.raise_fraction <= 1 and 0 < self.lower_fraction <= 1):
            raise ValueError(
                f"loss.adaptive.raise_fraction={self.raise_fraction} and lower_fraction="
                f"{self.lower_fraction} must be in (0, 1]"
            )
        if not 0 < self.calm_fraction <= 1:
            raise ValueError(f"loss.adaptive.calm_fraction={self.calm_fraction} must be in (0, 1]")
        if self.cooldown < 1:
            raise ValueError(f"loss.adaptive.cooldown={self.cooldown} must be at least 1 step")


@dataclass(frozen=True)
class ControllerSignals:
    """One step's early-warning signals (docs/algorithms.md 2.1-2.3)."""

    truncation_rate: float
    repetition_rate: float
    adv_gap: float = 0.0
    """adv/repetitive_mean - adv/regular_mean."""
    repetitive_share: float = 0.0
    """adv/repetitive_token_share."""
    reward: float | None = None
    """rollout/reward_mean (None: the step has no reward, and the reward signal does not count)."""


@dataclass(frozen=True)
class ControllerState:
    """Everything the rule remembers: plain numbers, JSON-ready for the checkpoint."""

    sft_weight: float
    ref_kl_weight: float
    truncation: tuple[float, ...] = ()
    """The last `window` truncation rates, oldest first."""
    repetition: tuple[float, ...] = ()
    calm_steps: int = 0
    """Calm steps in a row so far."""
    reward: tuple[float, ...] = ()
    """The last `window` rewards, oldest first."""
    reward_peak: float | None = None
    """The best `window`-step mean reward so far (a shorter window's while the run is younger)."""


@dataclass(frozen=True)
class Decision:
    action: str
    """"raise", "lower" or "hold"."""
    pressure: float
    reason: str
    """The signal with the largest pressure, e.g. "truncation_slope=0.021"."""


def slope(values: tuple[float, ...]) -> float:
    """Least-squares slope of values against 0, 1, 2, ... (per step); 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    t_mean, x_mean = (n - 1) / 2, sum(values) / n
    num = sum((t - t_mean) * (x - x_mean) for t, x in enumerate(values))
    return num / sum((t - t_mean) ** 2 for t in range(n))


def mean(values: tuple[float, ...]) -> float:
    return sum(values) / len(values)


def _with_reward(state: ControllerState, reward: float | None, cfg: AdaptiveConfig) -> ControllerState:
    """The reward window and its peak after this step's reward (unchanged when the step has none). The peak is
    of `window`-step means (of the whole history while it is shorter, from min_history values on), so one
    lucky step does not set it."""
    if reward is None:
        return state
    rewards = (*state.reward, float(reward))[-cfg.window :]
    if len(rewards) < cfg.min_history:
        return dataclasses.replace(state, reward=rewards)
    now = mean(rewards)
    peak = now if state.reward_peak is None else max(state.reward_peak, now)
    return dataclasses.replace(state, reward=rewards, reward_peak=peak)


def pressure(state: ControllerState, s: ControllerSignals, cfg: AdaptiveConfig) -> tuple[float, str]:
    """The largest of the signals' ratios to their thresholds, with its name; state holds this step's rates."""
    parts = {
        "truncation_rate": s.truncation_rate / cfg.truncation_level,
        "repetition_rate": s.repetition_rate / cfg.repetition_level,
    }
    if len(state.truncation) >= cfg.min_history:
        parts["truncation_slope"] = slope(state.truncation) / cfg.truncation_slope
        parts["repetition_slope"] = slope(state.repetition) / cfg.repetition_slope
    if s.repetitive_share >= cfg.gap_min_share:
        parts["adv_gap"] = s.adv_gap / cfg.gap
    if cfg.reward_drop > 0 and state.reward_peak is not None and len(state.reward) >= cfg.min_history:
        parts["reward_drop"] = (state.reward_peak - mean(state.reward[-cfg.min_history :])) / cfg.reward_drop
    name = max(parts, key=parts.get)
    scale = {
        "truncation_rate": cfg.truncation_level,
        "repetition_rate": cfg.repetition_level,
        "truncation_slope": cfg.truncation_slope,
        "repetition_slope": cfg.repetition_slope,
        "adv_gap": cfg.gap,
        "reward_drop": cfg.reward_drop,
    }
    return parts[name], f"{name}={parts[name] * scale[name]:.4g}"


def _move(state: ControllerState, cfg: AdaptiveConfig, fraction: float) -> tuple[float, float]:
    """Both weights moved by `fraction` of their ranges (negative: down), clamped to the bounds."""

    def one(w, lo, hi):
        return min(hi, max(lo, w + fraction * (hi - lo)))

    return (
        one(state.sft_weight, cfg.sft_weight_min, cfg.sft_weight_max),
        one(state.ref_kl_weight, cfg.ref_kl_weight_min, cfg.ref_kl_weight_max),
    )


def control_step(
    state: ControllerState, signals: ControllerSignals, cfg: AdaptiveConfig
) -> tuple[ControllerState, Decision]:
    """The rule of the module docstring: the next state and the decision, from this step's signals."""
    w = cfg.window
    state = dataclasses.replace(
        state,
        truncation=(*state.truncation, float(signals.truncation_rate))[-w:],
        repetition=(*state.repetition, float(signals.repetition_rate))[-w:],
    )
    state = _with_reward(state, signals.reward, cfg)
    p, reason = pressure(state, signals, cfg)
    if p >= 1.0:
        sft, kl = _move(state, cfg, cfg.raise_fraction)
        return dataclasses.replace(state, sft_weight=sft, ref_kl_weight=kl, calm_steps=0), Decision("raise", p, reason)
    if p >= cfg.calm_fraction:
        return dataclasses.replace(state, calm_steps=0), Decision("hold", p, reason)
    calm = state.calm_steps + 1
    if calm < cfg.cooldown:
        return dataclasses.replace(state, calm_steps=calm), Decision("hold", p, reason)
    sft, kl = _move(state, cfg, -cfg.lower_fraction)
    return dataclasses.replace(state, sft_weight=sft, ref_kl_weight=kl, calm_steps=calm), Decision("lower", p, reason)


@dataclass
class WeightChange:
    """A step at which the weights moved (the trainer logs it as a `loss_controller` event)."""

    step: int
    decision: Decision
    before: tuple[float, float]
    after: tuple[float, float]

    @property
    def message(self) -> str:
        d = self.decision
        return (
            f"{d.action} sft_weight {self.before[0]:.4g} -> {self.after[0]:.4g}, ref_kl_weight "
            f"{self.before[1]:.4g} -> {self.after[1]:.4g} (pressure {d.pressure:.3g}, {d.reason})"
        )


@dataclass
class WeightController:
    """The trainer's side: current weights, the loss bound at them, checkpointable state."""

    cfg: AdaptiveConfig
    base: BoundLoss
    """stable_opd as configured; its needs are those at the ceilings (golden data and the reference are
    loaded whenever a ceiling is above 0, so a raise has them)."""
    state: ControllerState = field(init=False)
    last_pressure: float = field(init=False, default=0.0)
    """The pressure of the last observed step (a metric; not part of the state)."""

    def __post_init__(self):
        c, cfg = self.base.config, self.cfg
        self.state = ControllerState(
            min(cfg.sft_weight_max, max(cfg.sft_weight_min, c.sft_weight)),
            min(cfg.ref_kl_weight_max, max(cfg.ref_kl_weight_min, c.ref_kl_weight)),
        )
        self.loss = self._bind()

    def _bind(self) -> BoundLoss:
        config = dataclasses.replace(
            self.base.config, sft_weight=self.state.sft_weight, ref_kl_weight=self.state.ref_kl_weight
        )
        return BoundLoss(self.base.name, self.base.fn, config, self.base.needs, off_policy=self.base.off_policy)

    def observe(self, step: int, signals: ControllerSignals) -> WeightChange | None:
        """Feeds one step's signals; returns the change when the weights moved (None otherwise)."""
        before = (self.state.sft_weight, self.state.ref_kl_weight)
        self.state, decision = control_step(self.state, signals, self.cfg)
        self.last_pressure = decision.pressure
        after = (self.state.sft_weight, self.state.ref_kl_weight)
        if after == before:
            return None
        self.loss = self._bind()
        return WeightChange(step, decision, before, after)

    def state_dict(self) -> dict:
        s = self.state
        return {
            "sft_weight": s.sft_weight,
            "ref_kl_weight": s.ref_kl_weight,
            "truncation": list(s.truncation),
            "repetition": list(s.repetition),
            "calm_steps": s.calm_steps,
            "reward": list(s.reward),
            "reward_peak": s.reward_peak,
        }

    def load_state_dict(self, state: dict) -> None:
        # reward / reward_peak: absent from checkpoints written before the reward signal (it starts afresh).
        self.state = ControllerState(
            float(state["sft_weight"]),
            float(state["ref_kl_weight"]),
            tuple(state["truncation"]),
            tuple(state["repetition"]),
            int(state["calm_steps"]),
            tuple(state.get("reward", ())),
            state.get("reward_peak"),
        )
        self.loss = self._bind()


def adaptive_needs(name: str, config, cfg: AdaptiveConfig):
    """stable_opd's needs at the ceilings of the bounds."""
    ceiling = dataclasses.replace(config, sft_weight=cfg.sft_weight_max, ref_kl_weight=cfg.ref_kl_weight_max)
    return build_loss(name, ceiling).needs


def build_controlled_loss(
    name: str, config, controller: str, adaptive: AdaptiveConfig
) -> tuple[BoundLoss, WeightController | None]:
    """The loss, and its controller when `controller` is adaptive (stable_opd only)."""
    if controller not in CONTROLLERS:
        raise ValueError(f"loss.controller={controller!r}: use one of {', '.join(CONTROLLERS)}")
    loss = build_loss(name, config)
    if controller == "fixed":
        return loss, None
    if name != "stable_opd":
        raise ValueError(
            f"loss.controller=adaptive moves stable_opd's sft_weight and ref_kl_weight; loss.name="
            f"{name!r} has neither: use loss.name=stable_opd or loss.controller=fixed"
        )
    loss = BoundLoss(loss.name, loss.fn, loss.config, adaptive_needs(name, loss.config, adaptive))
    return loss, WeightController(adaptive, loss)
