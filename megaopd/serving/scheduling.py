"""Request scheduling of `megaopd serve`: one thread decodes queued rows; every request that arrives while
a batch decodes joins the next batch.

    scheduler = Scheduler(runner)
    results = scheduler.run(rows)      # from any HTTP thread: waits for the batch its rows joined
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from megaopd.engine.rows import RowRequest, RowResult
from megaopd.engine.runner import ModelRunner


@dataclass
class _Job:
    rows: list[RowRequest]
    epoch: int
    """The runner's abort epoch when the job was queued: an abort since then ends its rows "abort"."""
    future: Future


class Scheduler:
    """One thread that decodes queued rows; everything queued while a batch runs joins the next one."""

    def __init__(self, engine: ModelRunner):
        self.engine = engine
        self.queue: "queue.Queue[_Job]" = queue.Queue()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="megaopd-serve-scheduler", daemon=True)
        self.thread.start()

    def submit(self, rows: list[RowRequest]) -> Future:
        job = _Job(rows, self.engine.abort_epoch, Future())
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
                    results = self.engine.run(rows, epoch=epoch)
                except BaseException as e:  # noqa: BLE001 - reported to every waiting request
                    for job in group:
                        job.future.set_exception(e)
                    continue
                i = 0
                for job in group:
                    job.future.set_result(results[i:i + len(job.rows)])
                    i += len(job.rows)
