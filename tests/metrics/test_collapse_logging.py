"""The trainer logs what the collapse detector raised under the event it names: a high truncation rate at
step 1 (a short token budget, no baseline yet) is a quiet collapse_no_baseline note, not a loud warning."""

import json
from types import SimpleNamespace

from megaopd.metrics import CollapseDetector
from megaopd.trainer.run_log import RunLog
from megaopd.trainer.step_metrics import RolloutSignals
from megaopd.trainer.trainer import Trainer


def test_step_one_truncation_is_a_note_and_a_later_rise_a_warning(tmp_path, capsys):
    log = RunLog(str(tmp_path), max_steps=20, tensorboard=False, progress_bar="off")
    trainer = SimpleNamespace(rank=0, run_log=log, detector=CollapseDetector(), step=0, _last_metrics=None)
    try:
        for step, trunc in enumerate([0.9, 0.9, 0.1, 0.1, 0.1, 0.1, 0.8], start=1):
            trainer.step = step
            signals = RolloutSignals(truncation_rate=trunc, repetition_rate=0.0, reward_mean=0.0)
            result = SimpleNamespace(log=signals.log, signals=signals)  # a StepResult's two parts _log reads
            Trainer._log(trainer, result)
    finally:
        log.close()
    out = capsys.readouterr().out.splitlines()
    events = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"event"' in line]
    assert [(e["step"], e["event"]) for e in events] == [(1, "collapse_no_baseline"), (7, "collapse_warning")]
    assert "no baseline yet" in events[0]["message"]
    loud = [line for line in out if line.startswith("!!! WARNING")]
    assert len(loud) == 1 and loud[0].startswith("!!! WARNING step 7 collapse_warning")
    assert any(line.startswith("step 1 collapse_no_baseline: truncation_rate = 0.900") for line in out)
