"""PreemptionFlag: the flag's collective runs on the default group's device, and after a signal an engine
call that fails (a SIGTERMed engine) is skipped so the checkpoint is still written."""

import os
import signal

import pytest
import torch

from megaopd.trainer import preemption


def test_flag_tensor_lives_on_the_group_device(monkeypatch):
    seen = {}
    target = torch.device("cpu")
    calls = []
    monkeypatch.setattr(preemption, "device", lambda: calls.append(1) or target)
    monkeypatch.setattr(preemption.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(preemption.dist, "get_world_size", lambda group=None: 2)

    def all_reduce(t, op=None, group=None):
        seen["device"] = t.device
        t.fill_(1.0)  # another rank got the signal

    monkeypatch.setattr(preemption.dist, "all_reduce", all_reduce)
    flag = preemption.PreemptionFlag(signals=())
    assert flag.should_stop() is True
    assert calls and seen["device"] == target


def test_engine_failure_after_signal_is_not_fatal():
    flag = preemption.PreemptionFlag(signals=(signal.SIGUSR1,))
    try:

        def dead_engine():
            raise ConnectionRefusedError("engine at http://node1:30000 refused")

        with pytest.raises(ConnectionRefusedError):  # before a signal: a real error
            flag.engine_call_after_signal(dead_engine, "weight sync")
        assert flag.engine_call_after_signal(lambda: 5, "weight sync") == 5
        os.kill(os.getpid(), signal.SIGUSR1)
        lines = []
        assert flag.engine_call_after_signal(dead_engine, "weight sync", log=lines.append) is None
        assert "weight sync failed after signal SIGUSR1" in lines[0] and "checkpointing" in lines[0]
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


_RANK = """
import sys, time
from megaopd.trainer.preemption import PreemptionFlag
flag = PreemptionFlag()
open(sys.argv[1], "w").close()
while flag.received is None:
    time.sleep(0.01)
"""


def test_copies_of_the_signal_while_the_rank_exits_do_not_kill_it(tmp_path):
    """A rank gets USR1 more than once (srun, torchrun_node.sh, the launcher). One that arrives while the
    interpreter exits finds the default action unless the rank ignores it there (Python resets its handlers
    then), and kills the rank that had saved its checkpoint: exit -10, and the job does not requeue. Copies are
    sent here until the process is gone."""
    import subprocess
    import sys
    import time

    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _RANK, str(ready)])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        deadline = time.monotonic() + 60  # the process exits within a second of the first signal
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                break
            time.sleep(0.0005)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_rank_installs_its_flag_before_it_imports_and_builds_the_trainer(monkeypatch):
    """A signal during the rank's imports and model builds (minutes at 7B) is kept for the first step's check."""
    import sys
    import types

    from megaopd.trainer import cli

    seen = {}

    class Trainer:  # stands in for megaopd.trainer.trainer.Trainer, which the rank imports after the flag
        def __init__(self, cfg, preemption=None):
            seen["handler"] = signal.getsignal(signal.SIGUSR1)
            seen["flag"] = preemption
            self.run_log = None

        def train(self):
            return {"preempted": False}

    monkeypatch.setitem(sys.modules, "megaopd.trainer.trainer", types.SimpleNamespace(Trainer=Trainer))
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        assert cli.run_worker(0, 1, cfg=None) == {"preempted": False}
        assert isinstance(seen["flag"], preemption.PreemptionFlag)
        # during the start-up the handler sets the flag and ends the start-up (tests/trainer/test_start_faults.py)
        assert seen["handler"] not in (signal.SIG_DFL, signal.SIG_IGN, None)
        assert signal.getsignal(signal.SIGUSR1) == seen["flag"]._handle  # the step loop's
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
