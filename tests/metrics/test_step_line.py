"""The console step line names the engine/actor log-prob gap for what it measures: `gap` where the engine
held the trained weights (a sync check), `drift` beside `lag=N` where the rollouts lag by design
(rollout.mode one_step_off / async), so the intended one-version lag no longer reads like a failed sync."""

import json

from megaopd.trainer.run_log import RunLog, step_line

SYNC = {"loss/total": 0.5, "rollout/truncation_rate": 0.25, "sync/logprob_gap_max": 2.5e-6, "time/step": 1.25}


def test_sync_step_shows_gap_and_no_lag():
    assert step_line(3, SYNC) == "step 3 loss=0.5 trunc=0.25 gap=2.5e-06 s/step=1.25"


def test_lagged_step_shows_lag_and_drift():
    rec = dict(SYNC, **{"pipeline/staleness_max": 1.0, "sync/logprob_gap_max": 0.98})
    line = step_line(4, rec)
    assert line == "step 4 loss=0.5 trunc=0.25 lag=1 drift=0.98 s/step=1.25"
    assert "gap=" not in line


def test_lag_zero_step_of_an_overlapped_run_is_a_sync_check():
    # The first one_step_off step (and a resumed one) samples with the weights it trains: gap, lag 0.
    rec = dict(SYNC, **{"pipeline/staleness_max": 0.0})
    assert step_line(1, rec) == "step 1 loss=0.5 trunc=0.25 lag=0 gap=2.5e-06 s/step=1.25"


def test_validation_answers_found_in_the_line():
    assert step_line(10, {"val/accuracy": 0.0, "val/answers_found": 0.0}) == "step 10 val_acc=0 val_found=0"


def test_run_log_prints_the_step_line_and_keeps_the_metric_keys(tmp_path, capsys):
    log = RunLog(str(tmp_path), max_steps=5, tensorboard=False, progress_bar="off")
    try:
        log.log_step(2, {"pipeline/staleness_max": 1.0, "sync/logprob_gap_max": 1.02})
    finally:
        log.close()
    assert capsys.readouterr().out.splitlines() == ["step 2 lag=1 drift=1.02"]
    (rec,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert (rec["pipeline/staleness_max"], rec["sync/logprob_gap_max"]) == (1.0, 1.02)  # keys unchanged
