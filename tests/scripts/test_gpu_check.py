"""scripts/gpu_check.sh --quick: the GPU check's CPU smoke mode end to end (tiny shapes, float32, gloo), so the
script a GPU session runs with little time and no network is known to start, run every part and write its
table. About 4-6 minutes on 2 shared cores (part c trains twice: killed, then resumed).

    pytest tests/scripts/test_gpu_check.py -x
"""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_gpu_check_quick_mode_passes_and_writes_its_table(tmp_path):
    env = dict(
        os.environ, OUT=str(tmp_path / "out"), MEGAOPD_GPU_CHECK_DIR=str(tmp_path / "work"), PYTHON=sys.executable
    )
    os.makedirs(env["OUT"])
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), "--quick"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    with open(os.path.join(env["OUT"], "gpu_check.md")) as f:
        table = f.read()
    for part in ("| a |", "| b |", "| c |", "| d |"):
        assert part in table, f"no rows of part {part} in the table:\n{table}"
    assert "| FAIL |" not in table
    assert "resume from the checkpoint" in table and "ops.logprobs_kl" in table and "loss stable_opd" in table


def test_gpu_check_rejects_unknown_parts():
    proc = subprocess.run(
        [sys.executable, "-m", "megaopd.gpucheck", "--quick", "--parts", "x"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown part" in proc.stderr


@pytest.mark.slow
def test_gpu_check_quick_benches_run(tmp_path):
    """--bench loss,packing in the CPU smoke mode: both measure and write their table (no FAIL rows)."""
    env = dict(
        os.environ, OUT=str(tmp_path / "out"), MEGAOPD_GPU_CHECK_DIR=str(tmp_path / "work"), PYTHON=sys.executable
    )
    os.makedirs(env["OUT"])
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), "--quick", "--bench", "loss,packing"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    with open(os.path.join(env["OUT"], "gpu_bench.md")) as f:
        table = f.read()
    assert "| FAIL |" not in table
    assert "step time padded / packed" in table and "fused Stable-OPD loss" in table
