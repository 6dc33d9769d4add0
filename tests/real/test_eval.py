"""`megaopd eval` of SmolLM2-135M-Instruct on a handful of arithmetic word problems (tests/real/data): it runs
with the model's chat template and writes its table, results and generations. Accuracy is reported, not
asserted: this model rarely writes the \\boxed{} answer the default grading reads (issue 44)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.real import reference

pytestmark = pytest.mark.slow

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "arithmetic.jsonl")
PROBLEMS = 4


def test_eval_writes_results(smollm2, tokenizer, tmp_path):
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "megaopd.cli", "eval", "--ckpt", smollm2, "--benchmarks", BENCH,
           "--limit", str(PROBLEMS), "--samples", "1", "--temperature", "0", "--max-new-tokens", "48",
           "--out", str(out), "--label", "smollm2"]
    env = {**os.environ, "PYTHONPATH": reference.ROOT, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=reference.ROOT)
    assert p.returncode == 0, f"megaopd eval exited {p.returncode}:\n{(p.stdout + p.stderr)[-6000:]}"
    assert "| Model | arithmetic |" in p.stdout, p.stdout[-2000:]
    assert {"results.md", "results.json", "generations.jsonl"} <= set(os.listdir(out))
    gens = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == PROBLEMS and all(isinstance(g["correct"], bool) for g in gens)
    # a real model answers in words and ends its turn (<|im_end|>) or runs to the budget
    assert all(g["response"].strip() and g["finish_reason"] in ("stop", "length") for g in gens), gens
    results = json.loads((out / "results.json").read_text())
    print(f"megaopd eval, SmolLM2-135M-Instruct on {PROBLEMS} problems: {json.dumps(results)[:600]}")
