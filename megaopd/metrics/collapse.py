"""Early warning of OPD collapse from the per-step truncation and repetition rates.

Collapse under plain OPD (docs/algorithms.md 2.8) shows as the truncation rate rising toward 1 and the
repetition rate jumping to 0.4-0.6 within a few dozen steps. The detector watches the fields of one typed
record, ResponseRates (metrics/rollout.py), each with its own thresholds (CollapseConfig.<field>: a
RateThresholds). It keeps, for each watched rate, the last `window` values; at each step it compares the new
value x_s with the window's mean m:
    jump alarm   x_s - m > <rate>.jump       (needs at least min_history earlier values)
    level alarm  x_s > <rate>.level
An alarm is raised once per episode: the metric must return below both thresholds before it can fire
again, so a collapsed run logs one warning, not one per step. The window holds values before the
current step only, so a jump is measured against the pre-jump baseline.

Collapse is a change, and a change needs a baseline: before min_history earlier values exist, a value over
its level raises no collapse warning but one quiet note (reason "no_baseline", event
`collapse_no_baseline`) that says the run starts there. Seen on SmolLM2-135M: a 96-token budget truncates
most responses from step 1, which read as a collapse warning at step 1. The note opens the episode like an
alarm, so a run that starts high and stays high is not warned about once the baseline fills either; it is
warned about when the rate falls below both thresholds and rises again, or jumps.

Pure Python with state_dict / load_state_dict, so a resumed run keeps its baseline.

    det = CollapseDetector(CollapseConfig())
    for step, rates in enumerate(step_rates):          # ResponseRates(truncation_rate=..., repetition_rate=...)
        for w in det.update(step, rates): log.warning(w.message)
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

from megaopd.metrics.rollout import ResponseRates


@dataclass
class RateThresholds:
    """The alarms of one watched rate; None leaves that alarm off."""

    jump: float | None = None
    """Alarm when value - mean(window) exceeds this (absolute rate difference)."""
    level: float | None = None
    """Alarm when the value itself exceeds this, whatever the baseline's value (once a baseline exists)."""

    def check(self, rate: str) -> None:
        for name, v in (("jump", self.jump), ("level", self.level)):
            if v is not None and v < 0:
                raise ValueError(f"metrics.collapse.{rate}.{name}={v} must be >= 0 (or null: no {name} alarm)")


@dataclass
class CollapseConfig:
    """The baseline window and the thresholds of each watched rate: one field per field of ResponseRates,
    under the same name (metrics.collapse.truncation_rate.jump, ...)."""

    window: int = 10
    """Steps in the moving baseline."""
    min_history: int = 3
    """Earlier values that make a baseline. Before them no collapse warning is raised: a jump cannot be
    judged, and a value over its level gets a quiet no-baseline note instead (the module docstring)."""
    truncation_rate: RateThresholds = field(default_factory=lambda: RateThresholds(jump=0.2, level=0.5))
    """Ours: healthy runs move by a few points per step; collapse takes the rate toward 1 within a few dozen."""
    repetition_rate: RateThresholds = field(default_factory=lambda: RateThresholds(jump=0.1, level=0.2))
    """Ours: collapse takes the rate to 0.4-0.6 within a few dozen steps (paper 2604.08527)."""

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"window={self.window} must be at least 1 step")
        if not 1 <= self.min_history <= self.window:
            raise ValueError(f"min_history={self.min_history} must be in [1, window={self.window}]")
        self.truncation_rate.check("truncation_rate")
        self.repetition_rate.check("repetition_rate")


def watched(rates: ResponseRates, cfg: CollapseConfig) -> tuple[tuple[str, float, RateThresholds], ...]:
    """Each watched rate: its name (the warnings' and the checkpoint's), this step's value, its thresholds. A new
    rate is a field of ResponseRates, one of CollapseConfig and one line here (tests/metrics/test_overlap_collapse.py
    holds the three to the same names)."""
    return (
        ("truncation_rate", rates.truncation_rate, cfg.truncation_rate),
        ("repetition_rate", rates.repetition_rate, cfg.repetition_rate),
    )


@dataclass
class CollapseWarning:
    step: int
    metric: str
    value: float
    baseline: float | None
    """Mean of the window before this step (None when the window was too short)."""
    reason: str
    """"jump" or "level" (collapse warnings), or "no_baseline" (over its level before a baseline exists)."""
    history: int = 0
    """Earlier values the baseline was made of."""
    threshold: float | None = None
    """The level or jump threshold the value crossed."""

    @property
    def is_collapse(self) -> bool:
        """A change against a baseline (jump or level), not a high start."""
        return self.reason != "no_baseline"

    @property
    def event(self) -> str:
        """The run log's event name: collapse_warning, or collapse_no_baseline for a high start."""
        return "collapse_warning" if self.is_collapse else "collapse_no_baseline"

    @property
    def message(self) -> str:
        if not self.is_collapse:
            hint = _START_HINTS.get(self.metric, "")
            return (
                f"{self.metric} = {self.value:.3f} at step {self.step} is above its level {self.threshold:g} with "
                f"no baseline yet ({self.history} earlier steps): too early to tell a collapse from where the run "
                f"starts{'; ' + hint if hint else ''}. A collapse warning follows if it falls below its "
                f"thresholds and rises again"
            )
        base = "n/a" if self.baseline is None else f"{self.baseline:.3f}"
        return (
            f"collapse warning at step {self.step}: {self.metric} = {self.value:.3f} ({self.reason}; "
            f"baseline over the last {self.history} steps {base})"
        )


_START_HINTS = {
    "truncation_rate": "responses cut off from the first steps usually mean a token budget "
    "(rollout.max_new_tokens) shorter than the model's answers",
}
"""What a high start of a watched rate usually means, for the no-baseline note."""


class CollapseDetector:
    def __init__(self, cfg: CollapseConfig | None = None):
        self.cfg = cfg or CollapseConfig()
        self._history: dict[str, deque[float]] = {}
        self._alarmed: dict[str, bool] = {}
        self.warnings: list[CollapseWarning] = []
        """Every warning raised so far (kept in state_dict, so a resumed run remembers them)."""

    def update(self, step: int, rates: ResponseRates) -> list[CollapseWarning]:
        """Feeds one step's rates; returns the warnings raised at this step (collapse warnings, and
        no-baseline notes: CollapseWarning.is_collapse tells them apart)."""
        raised = []
        for name, value, th in watched(rates, self.cfg):
            value = float(value)
            if th.jump is None and th.level is None:
                continue
            hist = self._history.setdefault(name, deque(maxlen=self.cfg.window))
            baseline = sum(hist) / len(hist) if hist else None
            has_baseline = len(hist) >= self.cfg.min_history
            reason, threshold = None, None
            if th.jump is not None and has_baseline and value - baseline > th.jump:
                reason, threshold = "jump", th.jump
            elif th.level is not None and value > th.level:
                reason, threshold = ("level" if has_baseline else "no_baseline"), th.level
            if reason is None:
                self._alarmed[name] = False
            elif not self._alarmed.get(name, False):
                self._alarmed[name] = True
                raised.append(CollapseWarning(step, name, value, baseline, reason, len(hist), threshold))
            hist.append(value)
        self.warnings.extend(raised)
        return raised

    @property
    def alarmed(self) -> bool:
        """True while any watched metric is above its thresholds (a high start included)."""
        return any(self._alarmed.values())

    def state_dict(self) -> dict:
        """The baseline windows, alarms and warnings by rate name (the names of ResponseRates' fields, as
        checkpoints have always keyed them)."""
        return {
            "history": {k: list(v) for k, v in self._history.items()},
            "alarmed": dict(self._alarmed),
            "warnings": [asdict(w) for w in self.warnings],
        }

    def load_state_dict(self, state: dict) -> None:
        self._history = {k: deque(v, maxlen=self.cfg.window) for k, v in state["history"].items()}
        self._alarmed = dict(state["alarmed"])
        self.warnings = [CollapseWarning(**w) for w in state["warnings"]]
