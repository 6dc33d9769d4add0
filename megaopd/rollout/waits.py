"""Waiting on an engine without waiting blind: the stall clock and the stop callback.

    raw = wait(attempt, "POST http://node1:30000/generate", stop=flag.signalled, stall_timeout_s=30,
               probe=makes_progress)     # attempt() runs in a thread; this one waits in slices

Every SLICE_S the waiting thread looks at stop() (the trainer's preemption flag: a signal arrived) and gives
the wait up with WaitAbandoned, so a rank blocked on an engine honours Slurm's signal in a fraction of a
second instead of after the request's timeout. And it keeps a stall clock: while attempt() is outstanding,
probe() runs in a thread of its own every few seconds; an answer to the request, or a probe that says the
engine makes progress, is a sign of life, and none for stall_timeout_s raises Silence (HttpEngine turns it into
EngineStalledError, naming the engine and what its probes saw).

Why a probe and not the request's own bytes: a non-streaming /generate (SGLang's and `megaopd serve`'s)
sends nothing until the whole batch is done, minutes on a long batch, so silence on its socket says nothing.
What a probe counts is the client's (HttpEngine): for a /generate, an engine that answers but is paused by
someone else (GET /ready: 503) is no progress, so a server left paused is named within stall_timeout_s
instead of after the request's timeout; for other requests any answer counts (a 503 too: SGLang answers
/health with 503 while it is busy in ways a run causes on purpose). A hung scheduler behind a live front end
that still says it is ready is SGLang's watchdog's (--watchdog-timeout kills the server, and the connection
errors that follow end the request).

rank0_waits is rank0_computes for rank 0's waits on engines: an abandoned wait reaches every rank, so they
all leave the step at the same point (the trainer then checkpoints and exits).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")

SLICE_S = 0.1
"""How often a waiting thread looks at stop() and the stall clock: the latency of both."""


class WaitAbandoned(RuntimeError):
    """stop() turned true (a preemption signal) while waiting on an engine: the wait was given up. Not an engine
    failure: nothing retries it and no engine is marked failed; the trainer checkpoints its last complete step."""


class Silence(Exception):
    """No sign of life from the engine for `seconds`: neither the request's answer nor a probe that said the
    engine makes progress."""

    def __init__(self, seconds: float):
        super().__init__(f"no progress for {seconds:.1f} s")
        self.seconds = seconds


def check_stop(stop: Callable[[], bool] | None, what: str) -> None:
    """WaitAbandoned when stop() is true: a wait that has not begun is not begun."""
    if stop is not None and stop():
        raise WaitAbandoned(f"{what}: abandoned, a stop was requested (preemption signal)")


def sleep(seconds: float, stop: Callable[[], bool] | None, what: str) -> None:
    """time.sleep that ends in WaitAbandoned as soon as stop() turns true (a retry's backoff)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        check_stop(stop, what)
        time.sleep(min(SLICE_S, left))
    check_stop(stop, what)


class _Life:
    """The stall clock: when the engine last answered anything, and the one probe in flight."""

    def __init__(self, probe: Callable[[], bool], every_s: float):
        self.last = time.monotonic()  # the wait's start: silence is counted from there
        self.probe, self.every_s = probe, every_s
        self.next_at, self.running = self.last + every_s, False

    def silent_for(self) -> float:
        now = time.monotonic()
        if not self.running and now >= self.next_at:  # one probe at a time: a stopped engine holds each one
            self.running, self.next_at = True, now + self.every_s
            threading.Thread(target=self._run, daemon=True, name="megaopd-probe").start()
        return now - self.last

    def _run(self) -> None:
        try:
            if self.probe():  # False: it answered, but shows no progress (paused): the clock runs on
                self.last = max(self.last, time.monotonic())
        except Exception:  # noqa: BLE001 - no answer is what the clock counts
            pass
        finally:
            self.running = False


def wait(
    attempt: Callable[[], T],
    what: str,
    stop: Callable[[], bool] | None = None,
    stall_timeout_s: float = 0.0,
    probe: Callable[[], bool] | None = None,
) -> T:
    """attempt() in a daemon thread; its result, or what it raised. Meanwhile, every SLICE_S: WaitAbandoned once
    stop() is true; Silence once neither attempt() has answered nor probe() has shown progress for
    stall_timeout_s (0: no clock). probe() runs every stall_timeout_s / 3 (at most every 5 s), one at a time:
    True when the engine makes progress, False when it answers but makes none, raises when it does not
    answer. A given-up attempt is left to its own timeout in its thread."""
    check_stop(stop, what)
    done, box = threading.Event(), {}

    def run():
        try:
            box["result"] = attempt()
        except BaseException as e:  # noqa: BLE001 - raised in the waiting thread
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="megaopd-request").start()
    life = _Life(probe, min(stall_timeout_s / 3, 5.0)) if stall_timeout_s > 0 and probe is not None else None
    while not done.wait(SLICE_S):
        check_stop(stop, what)
        if life is not None and (silent := life.silent_for()) > stall_timeout_s and not done.is_set():
            raise Silence(silent)
    if "error" in box:
        raise box["error"]
    return box["result"]


def rank0_waits(fn: Callable[..., T], *args, **kwargs) -> T:
    """rank0_computes (fn on global rank 0, its result on every rank; collective) for fn that waits on engines:
    when fn is abandoned there (WaitAbandoned), every rank raises WaitAbandoned at this point, instead of the
    others waiting for a result that never comes. Other errors are raised on rank 0, as rank0_computes does."""
    from megaopd.parallel.dist import rank0_computes

    def on_rank0():
        try:
            return False, fn(*args, **kwargs)
        except WaitAbandoned as e:
            return True, str(e)

    abandoned, out = rank0_computes(on_rank0)
    if abandoned:
        raise WaitAbandoned(out)
    return out
