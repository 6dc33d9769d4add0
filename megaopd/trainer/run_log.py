"""What a run writes as it goes: RUN/metrics.jsonl, RUN/tb (TensorBoard), RUN/samples/, the console.

Only the logging rank (0) creates a RunLog. Each step: one JSON object {"step": N, key: value, ...} in
metrics.jsonl (appended and flushed, so a killed run loses nothing already logged), the same scalars in
TensorBoard, one console line, and a progress bar when attached to a terminal. Events (collapse
warnings, checkpoints) go to metrics.jsonl as {"step": N, "event": NAME, ...} records.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

# The keys of the console line, in order, with their short labels.
_CONSOLE_KEYS = [
    ("loss/total", "loss"), ("rollout/truncation_rate", "trunc"), ("rollout/repetition_rate", "rep"),
    ("rollout/response_length_mean", "len"), ("rollout/advantage_mean", "adv"),
    ("sync/logprob_gap_max", "gap"), ("train/grad_norm", "gnorm"), ("val/accuracy", "val_acc"),
    ("time/step", "s/step"),
]


def _scalar(v):
    if hasattr(v, "item"):
        v = v.item()
    return v


class RunLog:
    def __init__(self, run_dir: str, max_steps: int, tensorboard: bool = True, progress_bar: str = "auto",
                 start_step: int = 0):
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

    def log_step(self, step: int, metrics: dict) -> None:
        record = {"step": step, "time": time.time()}
        for k, v in metrics.items():
            v = _scalar(v)
            if isinstance(v, float) and not math.isfinite(v):
                v = None if math.isnan(v) else (1e308 if v > 0 else -1e308)
            record[k] = v
            if self._tb is not None and isinstance(v, (int, float)) and not isinstance(v, bool):
                self._tb.add_scalar(k, v, step)
        self._write(record)
        line = " ".join(f"{label}={_fmt(record[k])}" for k, label in _CONSOLE_KEYS if record.get(k) is not None)
        self.console(f"step {step} {line}")
        if self._bar is not None:
            self._bar.update(1)

    def event(self, step: int, name: str, message: str, loud: bool = False, **fields) -> None:
        """A notable event, recorded in metrics.jsonl; `loud` ones (collapse warnings) stand out on the console."""
        self._write({"step": step, "event": name, "message": message, **fields})
        self.console(f"{'!!! WARNING ' if loud else ''}step {step} {name}: {message}")

    def samples(self, step: int, rows: list[dict]) -> None:
        with open(os.path.join(self.run_dir, "samples", f"step_{step:06d}.jsonl"), "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

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


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
