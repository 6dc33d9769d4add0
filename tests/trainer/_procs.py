"""The fault tests' processes and run folders: `python ...` and `megaopd train` on the tiny preset started in the
repository root with this checkout first on PYTHONPATH, one-rank run overrides, a run's logged steps, and the
check that a refusal is one line with its exit code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from tests.trainer.test_layouts import tiny_overrides
from tests.trainer.tiny_models import ROOT

PRESET = os.path.join(ROOT, "examples", "tiny", "stable_opd.yaml")


def train(overrides: list[str], env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """`megaopd train` on the tiny Stable-OPD preset with `overrides`, to its end (output captured)."""
    return subprocess.run(
        [sys.executable, *train_args(overrides)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_args(overrides: list[str]) -> list[str]:
    """python's arguments for `megaopd train` on the tiny preset (start_python takes them to run it in the
    background)."""
    return ["-m", "megaopd.cli", "train", PRESET, *overrides]


def one_rank_run(base, models, run_dir, steps: int, extra=()) -> list[str]:
    """The overrides of a one-rank tiny run (the pair `models` made under `base`) in `run_dir` to `steps`,
    saving every step."""
    student, teacher = models
    return [o for o in tiny_overrides(base, student, teacher, "x") if not o.startswith("run.dir")] + [
        f"run.dir={run_dir}",
        f"trainer.max_steps={steps}",
        "trainer.save_interval=1",
        "run.world_size=1",
        "student.tp=1",
        "reference.tp=1",
        "teacher.tp=1",
        *extra,
    ]


def step_rows(run: str) -> list[dict]:
    """The run's logged steps, in metrics.jsonl's order (events left out)."""
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "event" not in r]


def copy_run(run: str, tmp_path) -> str:
    """A copy of the run folder to break, under tmp_path."""
    out = str(tmp_path / "run")
    shutil.copytree(run, out)
    return out


def start_python(args: list[str], stderr=subprocess.STDOUT) -> subprocess.Popen:
    """`python ARGS` running in the background (its stdout piped as text; stderr: into stdout by default)."""
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def one_line_refusal(r: subprocess.CompletedProcess, code: int) -> str:
    """The single line on stderr of a run refused with exit `code` (asserted: the code and one line)."""
    assert r.returncode == code, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]
