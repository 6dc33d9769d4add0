"""Generation ahead of the trainer (rollout.mode one_step_off / async), on trainer rank 0: each batch is
generated in a thread of its own while the trainer trains on an earlier one; the records of who waited.

    ahead = GenerateAhead(generate)                  # generate(step, rows) -> list[Sample], thread-safe
    ahead.submit(step + 1, rows, version=step)       # returns at once; the engine works meanwhile
    taken = ahead.take(step)                          # waits (timed) for the batch of `step`
    taken.samples, taken.first_versions, taken.waited_s

A batch remembers the engine's weight version when it was submitted (the version of its first tokens);
a sample's own `weight_version` (the server's, at its last token) is the last. With one_step_off the two
are equal (weights change only between batches); with async a sync can land in the middle of a response
(a partial rollout), so a sample spans [first, last]. The server reports no finer spans than that.

Threads: HTTP generate calls release the GIL, so the trainer's torch work goes on meanwhile. Threads are
daemons: a preempted run exits without waiting for an engine that may already be gone.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from megaopd.rollout.protocol import Sample


@dataclass
class Taken:
    """One batch as the trainer takes it."""

    step: int
    samples: list[Sample]
    first_versions: list[int]
    """Weight version of each sample's first token (the engine's when the batch was submitted)."""
    waited_s: float
    """Seconds the trainer waited for it (0 when it was done before it was asked for)."""
    generate_s: float
    """Seconds the generation took, submit to done."""


@dataclass
class _Pending:
    step: int
    version: int
    submitted: float
    future: "Future[list[Sample]]"
    done_at: float | None = None


class GenerateAhead:
    def __init__(self, generate: Callable[[int, list[list[int]]], list[Sample]]):
        self.generate = generate
        self.pending: dict[int, _Pending] = {}
        self._last_done: float | None = None  # when the engine last ran out of submitted work
        self.engine_idle_s = 0.0
        """Seconds the engine had nothing submitted (it waited for the trainer), since the last read."""

    def submit(self, step: int, rows: list, version: int) -> None:
        """Starts generating the batch of `step` (its data rows) now, under the engine's weights `version`."""
        if step in self.pending:
            raise ValueError(f"the batch of step {step} is already generating")
        now = time.perf_counter()
        if not self.pending and self._last_done is not None:
            self.engine_idle_s += max(0.0, now - self._last_done)
        p = _Pending(step, version, now, Future())

        def run():
            try:
                p.future.set_result(self.generate(step, rows))
            except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread by take()
                p.future.set_exception(e)
            finally:
                p.done_at = time.perf_counter()

        threading.Thread(target=run, daemon=True, name=f"megaopd-generate-{step}").start()
        self.pending[step] = p

    def has(self, step: int) -> bool:
        return step in self.pending

    @property
    def in_flight(self) -> list[int]:
        """Steps submitted and not taken, in step order."""
        return sorted(self.pending)

    def wait(self, step: int) -> None:
        """Blocks until the batch of `step` is generated (without taking it)."""
        self.pending[step].future.exception()

    def take(self, step: int) -> Taken:
        """The batch of `step` (waiting for it); re-raises what its generation raised."""
        if step not in self.pending:
            raise KeyError(f"no batch of step {step} was submitted (in flight: {self.in_flight})")
        p = self.pending.pop(step)
        t0 = time.perf_counter()
        samples = p.future.result()
        waited = time.perf_counter() - t0
        done_at = p.done_at if p.done_at is not None else time.perf_counter()
        if not self.pending:
            self._last_done = max(done_at, self._last_done or 0.0)
        return Taken(step, samples, [p.version] * len(samples), waited, done_at - p.submitted)

    def read_idle(self) -> float:
        """engine_idle_s since the last read (then 0)."""
        idle, self.engine_idle_s = self.engine_idle_s, 0.0
        return idle


def parse_version(version: str | None) -> int | None:
    """The trainer's weight versions are str(step); anything else (a server's "default") is unknown."""
    try:
        return int(version) if version is not None else None
    except ValueError:
        return None


@dataclass
class Staleness:
    """How far a batch's samples lag the weights that train on them."""

    first_B: list[int]
    """Weight version of each sample's first token."""
    last_B: list[int]
    """Of its last token (= first unless a sync landed while it generated)."""
    stale_B: list[bool]
    """The sample lags more than max_staleness versions (its first token's)."""


def staleness(taken: Taken, trained_version: int, max_staleness: int) -> Staleness:
    """Each sample's span of versions, and which are too stale to train on."""
    last = [parse_version(s.weight_version) for s in taken.samples]
    last = [f if v is None else max(v, f) for v, f in zip(last, taken.first_versions)]
    stale = [trained_version - f > max_staleness for f in taken.first_versions]
    return Staleness(list(taken.first_versions), last, stale)


@dataclass(frozen=True, kw_only=True)
class StaleHandled:
    """A taken batch after its too-stale samples were handled (rollout.stale_samples)."""

    samples: list[Sample]
    """The batch's samples as trained: dropped ones empty, regenerated ones fresh."""
    dropped: int = 0
    regenerated: int = 0


def overlap_metrics(
    taken: Taken, st: Staleness, handled: StaleHandled, max_staleness: int, engine_idle_s: float
) -> dict[str, float]:
    """pipeline/*: staleness (mean, max, over samples, by their first token), response tokens per weight
    version lag (tokens_lag_<s>, s = 0 .. max_staleness; a partial rollout counts under its first token's
    lag), who waited for whom and how long the batch generated, and the too-stale samples dropped or
    regenerated. taken.step is the version that trains on the batch."""
    trained_version, response_lens = taken.step, [len(s.output_ids) for s in handled.samples]
    waited_s, dropped, regenerated = taken.waited_s, handled.dropped, handled.regenerated
    lags = [trained_version - f for f in st.first_B]
    out = {
        "pipeline/staleness_mean": sum(lags) / max(len(lags), 1),
        "pipeline/staleness_max": float(max(lags, default=0)),
        "pipeline/partial_fraction": sum(a != b for a, b in zip(st.first_B, st.last_B)) / max(len(lags), 1),
        "pipeline/trainer_wait_s": waited_s,
        "pipeline/engine_idle_s": engine_idle_s,
        "pipeline/dropped": float(dropped),
        "pipeline/regenerated": float(regenerated),
    }
    for s in range(max_staleness + 1):
        out[f"pipeline/tokens_lag_{s}"] = float(sum(n for n, lag in zip(response_lens, lags) if lag == s))
    out["pipeline/generate_s"] = taken.generate_s
    return out
