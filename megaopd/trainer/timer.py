"""Phase timings of a training step (NeMo-RL's Timer): named, nested, reduced across ranks, made into the
step's StepTimes record (trainer/step_metrics.py), which logs them as time/<name>.

    timer = Timer()
    with timer("step"):
        with timer("rollout"):
            ...
    timer.add("teacher_remote", seconds)              # measured elsewhere (rank 0's scoring thread)
    times = StepTimes(**timer.reduce(group, device))  # {"rollout": s, "step": s} -> a record; collective

A name is flat (rollout, not step/rollout) however it is nested: each is a field of StepTimes, logged as
time/<name>, the names the run log, the benchmarks and the GPU check read. The seconds of one name add up
over its blocks. reduce() takes each name's maximum over the group's ranks (the step waits for the slowest)
and starts the timer afresh; every rank must time the same names in the same order (the step's code path,
which is collective).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
import torch.distributed as dist


class Timer:
    def __init__(self):
        self._seconds: dict[str, float] = {}
        """Seconds per name, in the order the names were first closed (the metrics' order)."""
        self._open: list[str] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Times the block under `name` (wall clock, perf_counter, the GPU's queued work included: a phase's
        kernels run asynchronously, so the clock reads after a synchronize, or the next phase (and its MFU)
        would be charged for them)."""
        if name in self._open:
            raise ValueError(f"timer {name!r} is already running: a name cannot nest inside itself")
        self._open.append(name)
        _sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._open.remove(name)
            _sync()
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Adds seconds measured elsewhere (another thread, another process) to `name`."""
        self._seconds[name] = self._seconds.get(name, 0.0) + float(seconds)

    def reduce(self, group: dist.ProcessGroup | None, device: torch.device) -> dict[str, float]:
        """{name: the largest seconds over the group's ranks} of every closed name; then empty.
        Collective over `group` (one all_reduce of float64 on `device`, the group's device); group None:
        this process alone."""
        if self._open:
            raise ValueError(f"timers {self._open} are still running: reduce after their blocks end")
        names = list(self._seconds)
        values = torch.tensor([self._seconds[n] for n in names], dtype=torch.float64, device=device)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        self._seconds = {}
        return dict(zip(names, values.tolist()))


def _sync() -> None:
    """Waits for the GPU's queued work (a no-op on CPU); once per phase boundary, so it costs nothing
    measurable, unlike per-kernel synchronization."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
