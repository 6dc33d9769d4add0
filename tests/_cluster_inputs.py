"""What a cluster job's environment names, built small for the tests that run its commands without a cluster
(tests/docs, tests/slurm, tests/config/test_paper_presets.py): the 7B models' config.json (tests/config/fixtures),
a training data row and a validation set."""

from __future__ import annotations

import json
import os
from pathlib import Path

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config", "fixtures")
ROW = {"problem": "1+1?", "answer": "2", "golden": "2"}


def cluster_inputs(tmp: Path, models: dict[str, str], extend_qwen: bool = True) -> dict[str, str]:
    """MODELS_DIR (one folder per name of `models`, holding the config.json of its fixture; with extend_qwen
    the Qwen students' context extended to 16k as docs/cluster.md says), TRAIN_DATA (one row), BENCH_DIR
    (math500.jsonl, one problem) and OUTPUT_ROOT, all under `tmp`."""
    models_dir = tmp / "models"
    for name, fixture in models.items():
        (models_dir / name).mkdir(parents=True)
        with open(os.path.join(FIXTURES, fixture, "config.json")) as f:
            cfg = json.load(f)
        if extend_qwen and name.startswith("Qwen"):
            cfg.update(rope_theta=40000.0, max_position_embeddings=16384)
        (models_dir / name / "config.json").write_text(json.dumps(cfg))
    (tmp / "data").mkdir()
    (tmp / "data" / "opd.jsonl").write_text(json.dumps(ROW) + "\n")
    (tmp / "bench").mkdir()
    (tmp / "bench" / "math500.jsonl").write_text(json.dumps({"id": "1", "problem": "1+1?", "answer": "2"}) + "\n")
    return {
        "MODELS_DIR": str(models_dir),
        "TRAIN_DATA": str(tmp / "data" / "opd.jsonl"),
        "BENCH_DIR": str(tmp / "bench"),
        "OUTPUT_ROOT": str(tmp / "runs"),
    }
