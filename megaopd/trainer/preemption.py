"""SIGTERM / SIGUSR1 (Slurm preemption, `scancel`, `--signal=USR1@120`): finish the current step, save a
checkpoint, exit 0 so the job can be requeued and resume.

The handler only sets a flag; the step loop checks it between steps, and the flag is all-reduced so
every rank stops after the same step even when the signal reached only some of them.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class PreemptionFlag:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.received: int | None = None
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def should_stop(self) -> bool:
        """Collective: True on every rank when any rank received a signal."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)
