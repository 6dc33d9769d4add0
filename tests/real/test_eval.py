"""`megaopd eval` of SmolLM2-135M-Instruct on a handful of arithmetic word problems (tests/real/data) with the
model's chat template: it writes its table, results and generations, and says how many responses had an answer.
This model answers in words and never writes \\boxed{}: read with the last-number extraction it has
answers, read with the paper's boxed rule (the same responses re-scored, not generated again) it has none, and
eval says so. Accuracy is reported, not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.real import reference

pytestmark = [pytest.mark.slow, pytest.mark.real]

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "arithmetic.jsonl")
PROBLEMS = 4


def _eval(smollm2: str, out, extract: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "megaopd.cli",
        "eval",
        "--ckpt",
        smollm2,
        "--benchmarks",
        BENCH,
        "--limit",
        str(PROBLEMS),
        "--samples",
        "1",
        "--temperature",
        "0",
        "--max-new-tokens",
        "48",
        "--extract",
        extract,
        "--out",
        str(out),
        "--label",
        "smollm2",
    ]
    env = {**os.environ, "PYTHONPATH": reference.ROOT, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=reference.ROOT, check=False)
    assert p.returncode == 0, (
        f"megaopd eval --extract {extract} exited {p.returncode}:\n{(p.stdout + p.stderr)[-6000:]}"
    )
    return p


def test_eval_reports_answers_found(smollm2, tmp_path):
    out = tmp_path / "eval"
    p = _eval(smollm2, out, "number")
    assert "| Model | arithmetic |" in p.stdout, p.stdout[-2000:]
    assert {"results.md", "results.json", "generations.jsonl"} <= set(os.listdir(out))
    gens = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == PROBLEMS and all(isinstance(g["correct"], bool) for g in gens)
    # a real model answers in words and ends its turn (<|im_end|>) or runs to the budget
    assert all(g["response"].strip() and g["finish_reason"] in ("stop", "length") for g in gens), gens
    number = json.loads((out / "results.json").read_text())
    assert number["extract"] == "number" and number["responses"] == PROBLEMS
    assert number["answers_found"] > 0, gens  # every response of a word problem holds a number
    assert f"answers found: {number['answers_found']} of {PROBLEMS} (extract=number)" in p.stdout, p.stdout[-2000:]

    boxed = _eval(smollm2, out, "boxed")  # the same responses, re-scored
    assert f"answers found: 0 of {PROBLEMS} (extract=boxed)" in boxed.stdout, boxed.stdout[-2000:]
    assert "megaopd eval: warning: 0 of" in boxed.stderr, boxed.stderr[-2000:]
    print(
        f"megaopd eval, SmolLM2-135M-Instruct on {PROBLEMS} problems: accuracy {number['average']:.2f} with "
        f"extract=number ({number['answers_found']} of {PROBLEMS} found), 0 of {PROBLEMS} found with extract=boxed; "
        f"responses: {[g['response'][:80] for g in gens]}"
    )
