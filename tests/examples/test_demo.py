"""The README's first command: `megaopd train examples/tiny/stable_opd.yaml` (what `make demo` runs) goes to
completion on CPU at student TP=2 on 2 processes, and the student's validation accuracy ends above where
it started."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.examples.test_tiny_models import MODELS, ROOT

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(MODELS, "manifest.json")),
                                reason="examples/tiny/models not built (python tools/build_tiny_models.py)")


@pytest.mark.slow
def test_tiny_stable_opd_raises_validation_accuracy(tmp_path):
    run = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "megaopd.cli", "train", os.path.join(ROOT, "examples", "tiny", "stable_opd.yaml"),
                        f"run.dir={run}", "logging.tensorboard=false"], cwd=ROOT, capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    before, after = summary["val_before"]["val/accuracy"], summary["val/accuracy"]
    assert after > before, (before, after)
    assert "validation accuracy" in r.stdout  # the final summary the README promises
    assert (run / "plots" / "collapse.png").stat().st_size > 10_000
    assert (run / "hf" / "model.safetensors").exists()
