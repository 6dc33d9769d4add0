"""SIGTERM / SIGUSR1 (Slurm preemption, `scancel`, the time-limit warning): finish the current step, save a
checkpoint, exit 0 so the job can be requeued and resume.

The handler only sets a flag; the step loop checks it between steps, and the flag is all-reduced so
every rank stops after the same step even when the signal reached only some of them. A step that waits on
the engines does not wait for them to finish: `signalled` is the engines' stop callback (HttpEngine's,
megaopd.rollout.waits), so rank 0's waits (rollout, served scoring, weight sync) end within a fraction of a
second with WaitAbandoned, every rank learns it at the collective that carries rank 0's engine work, and the
trainer checkpoints the last complete step (the step in flight is dropped and drawn again on resume). The flag tensor
lives
on the default group's device (`megaopd.parallel.dist.device()`: the rank's GPU under NCCL, which refuses
CPU tensors; the CPU under gloo).

A real preemption SIGTERMs the engines too, so once a signal is in, anything that talks to an engine may
fail: `engine_call_after_signal` turns such a failure into a logged skip, so the checkpoint is still written.
The checkpoint itself never talks to an engine. Lead time: docs/cluster.md ("Preemption").
"""

from __future__ import annotations

import signal
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from megaopd.parallel.dist import device

T = TypeVar("T")


class PreemptionFlag:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.received: int | None = None
        self.signals = tuple(signals)
        for sig in self.signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum
        # Later ones are ignored. A rank gets the same signal more than once (srun forwards it to every process
        # of the step, torchrun_node.sh and the launcher pass it on too), and one that lands after the
        # interpreter has begun to exit finds its Python handler reset to the default action: the rank that
        # saved its checkpoint would die of it (exit -10 for USR1), and the job would not requeue. An
        # ignored signal stays ignored to the end.
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)

    def signalled(self) -> bool:
        """A signal reached this process (a plain read: safe from any thread, no collective; the engines' stop
        callback). should_stop is the collective decision."""
        return self.received is not None

    def should_stop(self, group: dist.ProcessGroup | None = None) -> bool:
        """Collective over `group` (default: the default group): True on every rank when any rank received
        a signal."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=device())
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def engine_call_after_signal(self, fn: Callable[[], T], what: str, log: Callable[[str], None] = print) -> T | None:
        """Runs fn (a call to the rollout engines: weight sync, release, generation). Before any signal its
        errors propagate as usual; after one, the engines may already be dead (Slurm's preemption SIGTERMs
        every step), so an error is logged and None returned: the step loop goes on to the checkpoint."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - any transport error of a dead engine
            if self.received is None:
                raise
            log(
                f"{what} failed after signal {signal.Signals(self.received).name} ({type(e).__name__}: {e}); "
                f"the engines are likely gone: skipping it and checkpointing"
            )
            return None
