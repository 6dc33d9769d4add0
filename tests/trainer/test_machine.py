"""`megaopd train` names the GPU-only settings a machine cannot run (bf16 training, the distributed optimizer,
sequence parallelism) before it starts a rank: the paper presets on a CPU machine failed minutes into start-up
with megatron's "Wrapped parameters must be one of torch.cuda.FloatTensor ..." or "sequence parallel not
supported by torch LayerNorm" traceback."""

import os
import subprocess
import sys
import time

import pytest
import torch

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from megaopd.trainer.machine import gpu_only_settings
from tests.trainer.tiny_models import ROOT

PRESET = os.path.join(ROOT, "examples", "tiny", "stable_opd.yaml")
GPU_ONLY = [
    "student.dtype=bfloat16",
    "optimizer.use_distributed_optimizer=true",
    "student.sequence_parallel=true",
    "teacher.tp=2",
    "teacher.sequence_parallel=true",
]


def test_each_gpu_only_setting_is_named_with_its_fix():
    cfg = load_config(MegaOPDConfig, PRESET, GPU_ONLY)
    cpu = gpu_only_settings(cfg, cuda=False, transformer_engine=False)
    assert [line.split("=")[0] for line in cpu] == [
        "student.dtype",
        "optimizer.use_distributed_optimizer",
        "student.sequence_parallel",
        "teacher.sequence_parallel",
    ]
    assert "set student.dtype=float32" in cpu[0] and "set teacher.sequence_parallel=false" in cpu[3]
    no_te = gpu_only_settings(cfg, cuda=True, transformer_engine=False)
    assert len(no_te) == 2 and all("Transformer Engine is not installed" in line for line in no_te)
    assert gpu_only_settings(cfg, cuda=True, transformer_engine=True) == []
    assert gpu_only_settings(load_config(MegaOPDConfig, PRESET, []), cuda=False, transformer_engine=False) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_train_refuses_before_starting_a_rank(tmp_path):
    run = tmp_path / "run"
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "megaopd.cli", "train", PRESET, f"run.dir={run}", "student.dtype=bfloat16"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == (
        "megaopd train: student.dtype=bfloat16 trains only on a GPU (megatron's mixed-precision "
        "optimizer takes CUDA tensors): set student.dtype=float32 on this machine"
    )
    assert not run.exists()  # nothing started: no run folder
    print(f"refused in {time.time() - t0:.1f} s")
