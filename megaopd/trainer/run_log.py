"""What a run writes as it goes: RUN/metrics.jsonl, RUN/tb (TensorBoard), Weights & Biases, RUN/samples/,
the console.

Only the logging rank (0) creates a RunLog. Each step: one JSON object {"step": N, key: value, ...} in
metrics.jsonl (appended and flushed, so a killed run loses nothing already logged), the same scalars in
TensorBoard and W&B, one console line, and a progress bar when attached to a terminal. Events (collapse
warnings, checkpoints) go to metrics.jsonl as {"step": N, "event": NAME, ...} records and to W&B as an
"events" table (plus event/<name> = 1 at that step). Sample rows go to RUN/samples/step_N.jsonl and a W&B
"samples" table; evaluation results (evaluation()) to an "eval/table" with a row per evaluated step.

W&B (logging.wandb, off unless project is set): the run folder's RUN/wandb/ holds W&B's own files
(mode offline: an offline-run-* folder to `wandb sync` later). Every record carries the trainer step as
the "step" metric, the x-axis of every chart, rather than W&B's internal step: a run resumed from an
earlier checkpoint logs steps again and W&B would drop them. The W&B run id is kept in
RUN/wandb_run_id, so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass, field

# The keys of the console line, in order, with their short labels (docs/architecture.md, "The step line").
_CONSOLE_KEYS = [
    ("loss/total", "loss"),
    ("rollout/truncation_rate", "trunc"),
    ("rollout/repetition_rate", "rep"),
    ("rollout/response_length_mean", "len"),
    ("rollout/advantage_mean", "adv"),
    ("pipeline/staleness_max", "lag"),
    ("sync/logprob_gap_max", "gap"),
    ("train/grad_norm", "gnorm"),
    ("val/accuracy", "val_acc"),
    ("val/answers_found", "val_found"),
    ("time/step", "s/step"),
]
_LOGPROB_GAP = "sync/logprob_gap_max"


def step_line(step: int, record: dict) -> str:
    """The console line of a step: "step 3 loss=0.12 ... lag=1 drift=0.98 ..." (keys the record lacks are left out).

    The engine/actor log-prob gap is named for what it measures. With the engine on the trained weights (sync
    mode; a lag-0 step of an overlapped one) it is `gap`: round-off, and a large one means a broken weight
    sync. Where the rollouts lag (`lag`, versions: pipeline/staleness_max, 1 in one_step_off by design) the
    engine sampled with older weights, so the same number is mostly the policy's change since: `drift`."""
    lagged = (record.get("pipeline/staleness_max") or 0) > 0
    parts = []
    for key, label in _CONSOLE_KEYS:
        if record.get(key) is None:
            continue
        parts.append(f"{'drift' if key == _LOGPROB_GAP and lagged else label}={_fmt(record[key])}")
    return f"step {step} " + " ".join(parts)


def _scalar(v):
    if hasattr(v, "item"):
        v = v.item()
    return v


class WandbSink:
    """The W&B side of a RunLog (imported only when configured)."""

    def __init__(self, run_dir: str, cfg, config: dict | None = None):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError(
                "logging.wandb.project is set but wandb is not installed: pip install "
                "'megaopd[wandb]' (or set logging.wandb.mode=disabled)"
            ) from e
        self._wandb = wandb
        id_file = os.path.join(run_dir, "wandb_run_id")
        run_id = open(id_file).read().strip() if os.path.exists(id_file) else uuid.uuid4().hex[:12]
        with open(id_file, "w") as f:
            f.write(run_id + "\n")
        # console="off": W&B would otherwise wrap this process's stdout/stderr (the console lines are
        # already in metrics.jsonl); no system-metrics sampler thread beside the training loop.
        self.run = wandb.init(
            project=cfg.project,
            name=cfg.name or os.path.basename(os.path.abspath(run_dir)),
            mode=cfg.mode,
            dir=run_dir,
            id=run_id,
            resume="allow",
            config=config,
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self._events: list[list] = []
        self._eval_rows: list[list] = []
        self._eval_columns: list[str] | None = None

    def log(self, step: int, values: dict) -> None:
        self.run.log({**values, "step": step})

    def event(self, step: int, name: str, message: str) -> None:
        self._events.append([step, name, message])
        # W&B tables are immutable once logged: log the whole table again with the new row.
        self.log(
            step,
            {
                f"event/{name}": 1,
                "events": self._wandb.Table(columns=["step", "event", "message"], data=[list(r) for r in self._events]),
            },
        )

    def samples(self, step: int, rows: list[dict]) -> None:
        if not rows:
            return
        columns = list(rows[0])
        data = [[_table_cell(r.get(c)) for c in columns] for r in rows]
        self.log(step, {"samples": self._wandb.Table(columns=["step", *columns], data=[[step, *d] for d in data])})

    def evaluation(self, step: int, columns: list[str], row: list) -> None:
        if self._eval_columns != columns:  # other benchmarks than before: start the table again
            self._eval_columns, self._eval_rows = columns, []
        self._eval_rows.append([step, *row])
        self.log(
            step, {"eval/table": self._wandb.Table(columns=["step", *columns], data=[list(r) for r in self._eval_rows])}
        )

    def close(self) -> None:
        self.run.finish()


def _table_cell(v):
    v = _scalar(v)
    return v if v is None or isinstance(v, (str, int, float, bool)) else str(v)


class RunLog:
    def __init__(
        self,
        run_dir: str,
        max_steps: int,
        tensorboard: bool = True,
        progress_bar: str = "auto",
        start_step: int = 0,
        wandb=None,
        config: dict | None = None,
    ):
        """wandb: a trainer.config.WandbConfig (logging.wandb; None or no project: no W&B); config: the
        run's resolved config as a plain dict, shown in W&B's config panel."""
        self.run_dir = run_dir
        os.makedirs(os.path.join(run_dir, "samples"), exist_ok=True)
        self._metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
        show_bar = progress_bar == "on" or (progress_bar == "auto" and sys.stderr.isatty())
        self._bar = None
        if show_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=max_steps, initial=start_step, desc="megaopd", unit="step")
        self._wandb = WandbSink(run_dir, wandb, config) if wandb is not None and wandb.enabled else None

    def log_step(self, step: int, metrics: dict) -> None:
        record = {"step": step, "time": time.time()}
        scalars = {}
        for k, v in metrics.items():
            v = _scalar(v)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                scalars[k] = v  # W&B takes inf/nan as they are
            if isinstance(v, float) and not math.isfinite(v):
                v = None if math.isnan(v) else (1e308 if v > 0 else -1e308)
            record[k] = v
            if self._tb is not None and isinstance(v, (int, float)) and not isinstance(v, bool):
                self._tb.add_scalar(k, v, step)
        self._write(record)
        if self._wandb is not None:
            self._wandb.log(step, scalars)
        self.console(step_line(step, record))
        if self._bar is not None:
            self._bar.update(1)

    def event(self, step: int, name: str, message: str, loud: bool = False, **fields) -> None:
        """A notable event, recorded in metrics.jsonl; `loud` ones (collapse warnings) stand out on the console."""
        self._write({"step": step, "event": name, "message": message, **fields})
        if self._wandb is not None:
            self._wandb.event(step, name, message)
        self.console(f"{'!!! WARNING ' if loud else ''}step {step} {name}: {message}")

    def samples(self, step: int, rows: list[dict]) -> None:
        with open(os.path.join(self.run_dir, "samples", f"step_{step:06d}.jsonl"), "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.samples(step, rows)

    def evaluation(self, step: int, result) -> None:
        """An evaluation's table (megaopd.eval.EvalResult: the benchmark columns and Avg, in percent), as a
        row of W&B's "eval/table" and as TensorBoard text; its scalars go through log_step as usual."""
        columns = ["model", *[b.display for b in result.benchmarks], "Avg"]
        row = [result.label, *[round(100 * b.accuracy, 1) for b in result.benchmarks], round(100 * result.average, 1)]
        if self._tb is not None:
            self._tb.add_text("eval/table", result.markdown(), step)
        if self._wandb is not None:
            self._wandb.evaluation(step, columns, row)

    def console(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def _write(self, record: dict) -> None:
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()

    def close(self) -> None:
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def keep_rows_through(run_dir: str, step: int) -> list[str]:
    """Before a (re)started run appends to RUN/metrics.jsonl: rows of steps after `step` (the loaded
    checkpoint's; -1 for a run starting at 0) move to RUN/metrics.replaced_<time>.jsonl, so the file holds
    each step once. Returns the console line saying so (none when nothing moved)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is no record, not an error naming no file
        lines = [line for line in f if line.strip()]
    kept, moved, unreadable = [], [], 0
    for line in lines:
        try:
            row_step = json.loads(line).get("step", -1)
        except (ValueError, AttributeError):  # cut by a kill mid-write, not UTF-8 (UnicodeDecodeError), not a row
            row_step = None
            unreadable += 1
        (moved if row_step is None or row_step > step else kept).append(line)
    if not moved:
        return []
    side = os.path.join(run_dir, time.strftime("metrics.replaced_%Y%m%d_%H%M%S.jsonl", time.gmtime()))
    with open(side, "ab") as f:
        f.writelines(line if line.endswith(b"\n") else line + b"\n" for line in moved)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    bad = f" ({unreadable} of them not readable records of {path})" if unreadable else ""
    return [
        f"metrics.jsonl: moved {len(moved)} rows after step {max(step, 0)}{bad} to {side} (the steps are run again)"
    ]


@dataclass(kw_only=True)
class RunSummary:
    """What Trainer.train() tells its caller (megaopd train): the steps it ran, whether a preemption signal
    ended it, and the metrics the CLI prints and summary.json keeps."""

    start_step: int
    """The step the run started from (0, or the resumed checkpoint's)."""
    end_step: int
    """The last step trained (and checkpointed, when preempted)."""
    preempted: bool = False
    """A preemption signal ended the run: no final export, no summary.json."""
    val_before: dict[str, float] | None = None
    """Validation before step 1 (None: the run resumed, or validation is off)."""
    last_metrics: dict[str, float] = field(default_factory=dict)
    """The last step's logged metrics (validation included when it ran at that step)."""
    step_time_mean: float | None = None
    """Mean seconds per step of this start (None when preempted)."""

    def to_json(self) -> dict:
        """summary.json: the last step's metrics at the top level, with start_step, val_before and
        step_time_mean beside them."""
        out: dict = {"start_step": self.start_step}
        if self.val_before is not None:
            out["val_before"] = self.val_before
        out.update(self.last_metrics, step_time_mean=self.step_time_mean)
        return out


def write_summary(run_dir: str, summary: RunSummary) -> str:
    """RUN/summary.json: the run's final metrics (the CLI prints them)."""
    path = os.path.join(run_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary.to_json(), f, indent=1, default=float)
    return path
