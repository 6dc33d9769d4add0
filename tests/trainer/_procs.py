"""The fault tests' processes: `python ...` started in the repository root with this checkout first on
PYTHONPATH, and the check that a refusal is one line with its exit code."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.trainer.tiny_models import ROOT


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
