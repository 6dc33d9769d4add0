"""Weights & Biases beside TensorBoard (megaopd.trainer.run_log), in offline mode (no network), read back
with W&B's own reader of its .wandb record log (`wandb leet inspect --json`).

Fast-ish: a RunLog writes step metrics, a collapse event, a sample table and an evaluation table.
Slow: a tiny `megaopd train` run with logging.wandb.mode=offline writes the run's step metrics.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from megaopd.eval.evaluate import BenchmarkResult, EvalResult
from megaopd.trainer.config import WandbConfig
from megaopd.trainer.run_log import RunLog

pytest.importorskip("wandb")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_wandb_run(run_dir):
    """Records of the one offline W&B run under RUN/wandb, through W&B's own reader."""
    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    wandb_cli = shutil.which("wandb") or os.path.join(os.path.dirname(sys.executable), "wandb")
    out = subprocess.run(
        [wandb_cli, "leet", "inspect", "--json", path],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WANDB_SILENT": "true"},
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(x) for x in out.stdout.splitlines() if x.strip()]


def history(records):
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def test_wandb_config_checks_mode():
    assert not WandbConfig().enabled and not WandbConfig(project="p", mode="disabled").enabled
    assert WandbConfig(project="p", mode="offline").enabled
    with pytest.raises(ValueError, match="offline"):
        WandbConfig(mode="off")


def test_run_log_writes_an_offline_wandb_run(tmp_path):
    run = str(tmp_path)
    log = RunLog(
        run,
        max_steps=3,
        tensorboard=True,
        progress_bar="off",
        wandb=WandbConfig(project="megaopd-test", name="tiny", mode="offline"),
        config={"lr": 1e-3},
    )
    log.log_step(0, {"val/accuracy": 0.25})
    log.log_step(1, {"loss/total": 0.5, "rollout/truncation_rate": 0.1, "flag": True})
    log.samples(1, [{"prompt": "p", "response": "r", "finish_reason": "stop", "reward": 1.0}])
    log.event(2, "collapse_warning", "truncation rate 0.6 > 0.5", loud=True, metric="rollout/truncation_rate")
    bench = BenchmarkResult("aime24", "AIME24", "avg@2", 3, 2, 0.5, 1.0, 0.0, 0.0, 10.0, 1.0, answers_found=6)
    log.evaluation(2, EvalResult([bench], label="student"))
    log.log_step(2, {"loss/total": 0.25, "val/accuracy": 0.5})
    log.close()
    assert open(os.path.join(run, "wandb_run_id")).read().strip()
    records = read_wandb_run(run)
    (run_record,) = [r["run"] for r in records if r["type"] == "run"]
    assert run_record["project"] == "megaopd-test" and run_record["display_name"] == "tiny"
    hist = history(records)
    losses = [(h["step"], h["loss/total"]) for h in hist if "loss/total" in h]
    assert losses == [(1, 0.5), (2, 0.25)]
    assert [(h["step"], h["val/accuracy"]) for h in hist if "val/accuracy" in h] == [(0, 0.25), (2, 0.5)]
    assert any(h.get("event/collapse_warning") == 1 and h["step"] == 2 for h in hist)
    tables = {
        k: h["step"] for h in hist for k in ("samples", "events", "eval/table") if h.get(f"{k}._type") == "table-file"
    }
    assert tables == {"samples": 1, "events": 2, "eval/table": 2}
    # The tables' contents are W&B's media files beside the record log.
    files = glob.glob(os.path.join(run, "wandb", "offline-run-*", "files", "media", "table", "eval", "*.table.json"))
    (eval_file,) = files
    table = json.load(open(eval_file))
    assert table["columns"] == ["step", "model", "AIME24", "Avg"] and table["data"] == [[2, "student", 50.0, 50.0]]
    (events_file,) = glob.glob(
        os.path.join(run, "wandb", "offline-run-*", "files", "media", "table", "events_*.table.json")
    )
    assert json.load(open(events_file))["data"] == [[2, "collapse_warning", "truncation rate 0.6 > 0.5"]]
    # TensorBoard and metrics.jsonl are written as before.
    assert glob.glob(os.path.join(run, "tb", "events.out.tfevents.*"))
    assert len(open(os.path.join(run, "metrics.jsonl")).read().splitlines()) == 4


@pytest.mark.slow
def test_tiny_training_run_logs_to_offline_wandb(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "WANDB_SILENT": "true"}
    cmd = [
        sys.executable,
        "-m",
        "megaopd.cli",
        "train",
        os.path.join(ROOT, "examples", "tiny", "stable_opd.yaml"),
        f"run.dir={run}",
        "run.world_size=1",
        "student.tp=1",
        "reference.tp=1",
        "trainer.max_steps=2",
        "trainer.prompts_per_step=4",
        "trainer.samples_per_prompt=2",
        "trainer.micro_batch_size=4",
        "trainer.eval_interval=2",
        "validation.max_problems=4",
        "rollout.max_new_tokens=32",
        "validation.max_new_tokens=32",
        "logging.wandb.project=megaopd-tiny",
        "logging.wandb.mode=offline",
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    hist = history(read_wandb_run(str(run)))
    steps: dict = {}
    for h in hist:  # a step's metrics, samples, events and tables are separate W&B rows with the same "step"
        steps.setdefault(h["step"], {}).update(h)
    assert {1, 2} <= set(steps) and "loss/total" in steps[1] and "loss/total" in steps[2]
    assert "rollout/truncation_rate" in steps[2] and "val/accuracy" in steps[0] and "val/accuracy" in steps[2]
    metrics = [json.loads(x) for x in open(run / "metrics.jsonl")]
    by_step = {m["step"]: m for m in metrics if "event" not in m and "loss/total" in m}
    assert steps[2]["loss/total"] == pytest.approx(by_step[2]["loss/total"])
    assert any("eval/table._type" in h for h in hist) and any("samples._type" in h for h in hist)
