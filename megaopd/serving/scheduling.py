"""Request scheduling of `megaopd serve`: one thread decodes queued rows (every request that arrives while
a batch decodes joins the next batch), and SGLang's pause / abort / retract over those runs.

    scheduler = Scheduler(runner)
    results = scheduler.run(rows)            # from any HTTP thread: waits for the batch its rows joined
    scheduler.pauses.pause("retract")        # POST /pause_generation {"mode": "retract"}

Pause modes, as SGLang's /pause_generation: "in_place" holds the running rows at their next decode step
with their KV cache; "retract" holds them too and re-prefills them (prompt + tokens so far) when
generation continues, so tokens after a weight update come from the new weights; "abort" ends running and
queued rows with finish reason "abort" and holds what is submitted after it. /continue_generation ends a
hold; /abort_request {"abort_all": true} aborts without holding. While a run is held the model is free,
so a weight update loads between two decode steps instead of waiting for the batch to finish (the
runner's StepControl hook: megaopd.engine.runner).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from megaopd.engine.rows import RowRequest, RowResult
from megaopd.engine.runner import ModelRunner

PAUSE_MODES = ("abort", "retract", "in_place")


class PauseControl:
    """Whether generation is paused and how, and the abort epoch: a counter every abort increments, so
    the rows of a job queued before an abort end "abort" and later ones do not."""

    def __init__(self, wake: Callable[[], None]):
        self._wake = wake
        """Wakes held runs to look again (ModelRunner.wake)."""
        # Plain attributes: the decoding thread reads them at step boundaries, and a flag read a step
        # late only delays a pause by one token.
        self._paused = False
        self._mode = "in_place"
        self._epoch = 0

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def mode(self) -> str:
        """The last pause's mode."""
        return self._mode

    @property
    def epoch(self) -> int:
        """Incremented by every abort; a job keeps the value it was queued in (run_control)."""
        return self._epoch

    def pause(self, mode: str = "in_place") -> None:
        """Holds decoding at the next step boundary. mode: in_place | retract | abort (module docstring)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}; choose abort, retract or in_place")
        self._mode = mode
        self._paused = True
        if mode == "abort":
            self._epoch += 1
        self._wake()

    def continue_generation(self) -> None:
        self._paused = False
        self._wake()

    def abort_all(self) -> None:
        """Ends running and queued rows with finish reason "abort" (without pausing)."""
        self._epoch += 1
        self._wake()

    def run_control(self, epoch: int) -> "_RunControl":
        """The StepControl of a run whose rows were queued in abort epoch `epoch`."""
        return _RunControl(self, epoch)


@dataclass(frozen=True)
class _RunControl:
    """PauseControl as one run sees it (the runner's StepControl)."""

    pauses: PauseControl
    epoch: int

    def held(self) -> bool:
        return self.pauses.paused

    def aborted(self) -> bool:
        return self.pauses.epoch != self.epoch

    def retracting(self) -> bool:
        return self.pauses.mode == "retract"


@dataclass
class _Job:
    rows: list[RowRequest]
    epoch: int
    """The abort epoch when the job was queued: an abort since then ends its rows "abort"."""
    future: Future


class Scheduler:
    """One thread that decodes queued rows; everything queued while a batch runs joins the next one."""

    def __init__(self, engine: ModelRunner):
        self.engine = engine
        self.pauses = PauseControl(engine.wake)
        self.queue: "queue.Queue[_Job]" = queue.Queue()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="megaopd-serve-scheduler", daemon=True)
        self.thread.start()

    def submit(self, rows: list[RowRequest]) -> Future:
        job = _Job(rows, self.pauses.epoch, Future())
        self.queue.put(job)
        return job.future

    def run(self, rows: list[RowRequest], timeout: float | None = None) -> list[RowResult]:
        """The rows' results, in order, once the batch they joined has decoded."""
        return self.submit(rows).result(timeout=timeout)

    def stop(self) -> None:
        self.stopped.set()

    def _loop(self):
        while not self.stopped.is_set():
            try:
                jobs = [self.queue.get(timeout=0.2)]
            except queue.Empty:
                continue
            while True:
                try:
                    jobs.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            # Jobs from different abort epochs cannot share a run (an old one must come back aborted).
            by_epoch: dict[int, list[_Job]] = {}
            for job in jobs:
                by_epoch.setdefault(job.epoch, []).append(job)
            for epoch, group in by_epoch.items():
                rows = [r for job in group for r in job.rows]
                try:
                    results = self.engine.run(rows, self.pauses.run_control(epoch))
                except BaseException as e:  # noqa: BLE001 - reported to every waiting request
                    for job in group:
                        job.future.set_exception(e)
                    continue
                i = 0
                for job in group:
                    job.future.set_result(results[i : i + len(job.rows)])
                    i += len(job.rows)
