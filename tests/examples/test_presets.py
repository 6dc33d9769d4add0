"""Every shipped preset trains: each `examples/**/*.yaml` (found by glob, so a new preset is covered without
touching this file) runs 2 steps of `megaopd train` on CPU and exits 0, with 2 steps in metrics.jsonl and
finite losses.

What a case changes from the shipped file is all in the tables below, one per preset family (the folder under
examples/), each override with the reason it is needed; everything else runs as shipped: the loss and its
weights, rollout mode and sampling, validation settings, dtypes, sequence parallelism, the distributed
optimizer, offloading. examples/tiny presets run as they are, but for the step count and a smaller batch and
validation set; examples/paper and examples/qwen3 presets get tiny models and data in place of the 7B-32B
models and datasets they name, and a cluster's sizes (8 GPUs, 9216-token rows) scaled down to 2 CPU ranks;
examples/real presets get the tiny models in place of SmolLM2-135M and keep their own data.

Beside this file: test_paper_presets.py and test_qwen3_presets.py check what those presets resolve to at the
real models' sizes (`megaopd config`, `megaopd plan`), which no tiny run can; test_demo.py trains the demo for
its full 40 steps and checks it learns. This file is the only one that trains every preset as shipped.
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
import time

import pytest

from tests.trainer.tiny_models import ROOT, make_tiny_qwen3_pair

EXAMPLES = os.path.join(ROOT, "examples")
TINY_DATA = os.path.join(EXAMPLES, "tiny", "data")
TINY_MODELS = os.path.join(EXAMPLES, "tiny", "models")
PRESETS = sorted(
    os.path.relpath(p, EXAMPLES) for p in glob.glob(os.path.join(EXAMPLES, "**", "*.yaml"), recursive=True)
)

# Every case: two steps into the test's own folder (the preset's run.dir would resume an earlier run), no
# TensorBoard files (nothing reads them here).
EVERY = {"trainer.max_steps": "2", "run.dir": "{run}", "logging.tensorboard": "false"}

# Per family: {key: value} on top of EVERY. {models} is the family's tiny model folder, {data} examples/tiny/data.
FAMILIES = {
    # The tiny presets' own models, data and layouts (student TP=2 on 2 gloo workers), as shipped, but:
    "tiny": {
        # 32 prompts x 4 samples: the same code paths (4 micro-batches of 8 rows at DP=1) at a quarter of the
        # rollout and scoring time.
        "trainer.prompts_per_step": "8",
        # Validation still runs before step 1 and after step 2 (eval_interval 10-40 > max_steps: the last step
        # validates), on 8 of the 200 problems instead of all.
        "validation.max_problems": "8",
    },
    # Paper presets (2 nodes x 4 H200, Qwen2.5-Math-7B/1.5B students, 7B teachers, OpenR1-Math parquet, MATH-500):
    "paper": {
        # The trained tiny Qwen2 models (the same architecture family as Qwen2.5-Math) and the tiny chat
        # tokenizer they carry; the reference is the student (the presets set no reference path).
        "student.path": "{models}/student",
        "teacher.path": "{models}/teacher",
        # The tiny problems with golden solutions and answers, in the fields of the paper's data.
        "data.sources": "[{{path: {data}/opd.jsonl, weight: 1.0, max_rows: 64}}]",
        "validation.path": "{data}/val.jsonl",
        # 2 CPU ranks, not 8 GPUs: every TP=2 layout of the presets fits (DP=1 for TP=2, DP=2 for TP=1).
        "run.world_size": "2",
        # The presets' remote SGLang engines need GPUs (colocated engines take weights by CUDA IPC); the
        # embedded engine generates in rank 0 with the same sampling and honours rollout.colocated.
        "rollout.engine": "embedded",
        # Sequence parallelism needs Transformer Engine's norms (a GPU): megatron's local layers, the CPU's, refuse
        # it. The TP=2 layouts stay; their activations are kept whole on each TP rank instead of split.
        "student.sequence_parallel": "false",
        "reference.sequence_parallel": "false",
        "teacher.sequence_parallel": "false",
        # bfloat16 training and megatron-core 0.16's distributed optimizer take CUDA tensors only (megatron's
        # Float16Optimizer and DistributedOptimizer refuse CPU ones): float32 models and plain Adam on CPU.
        "student.dtype": "float32",
        "reference.dtype": "float32",
        "teacher.dtype": "float32",
        "optimizer.use_distributed_optimizer": "false",
        # 1024 + 8192-token rows do not fit the tiny models' 512 positions: 128 + 256.
        "data.max_prompt_len": "128",
        "data.max_golden_len": "256",
        "rollout.max_new_tokens": "64",
        "validation.max_new_tokens": "64",
        # 64 prompts x 4 samples -> 2 x 4 (the samples per prompt as shipped): 4 micro-batches of 2 rows.
        "trainer.prompts_per_step": "2",
        # All 500 MATH problems -> 8 of the tiny validation set.
        "validation.max_problems": "8",
    },
    # Real-model presets (examples/real: SmolLM2-135M-Instruct, layers 16-19 removed, from the full model; world
    # 1, float32, embedded engine, CPU sizes already): the tiny models in place of the two SmolLM2 folders, which
    # CI's preset matrix does not fetch (tests/real trains on them). Their own arithmetic data, budgets and
    # number extraction stay as shipped (the tiny tokenizer drops spaces, harmless for a 2-step run).
    "real": {
        "student.path": "{models}/student",
        "teacher.path": "{models}/teacher",
        # Validation still runs before step 1 and after step 2 (the last step validates), on 8 of the 60
        # problems instead of all.
        "validation.max_problems": "8",
    },
}
# Qwen3 presets (Qwen3-8B-Base student, Qwen3-32B or Qwen3-30B-A3B teacher, 2 nodes x 4 H200): the paper's
# overrides, with tiny random Qwen3 models (per-head q/k norm; the MoE teacher 8 experts, top 2) over the tiny
# tokenizer as their {models}.
FAMILIES["qwen3"] = FAMILIES["paper"]

# Per preset, on top of its family's (None: the family's override left out).
PRESET = {
    # No teacher and no validation as shipped (`teacher: {path: ""}`, `validation.path: ""`): keep them so.
    "paper/sft_cold_start_7b.yaml": {"teacher.path": None, "validation.path": None},
    # The dense teacher's TP=4 -> 2 (2 ranks); its folder is the dense tiny Qwen3 teacher.
    "qwen3/stable_opd_qwen3_8b.yaml": {"teacher.tp": "2", "teacher.path": "{models}/dense_teacher"},
    # The MoE teacher's EP=8 -> 2 (2 ranks; 8 tiny experts, 4 per rank).
    "qwen3/stable_opd_qwen3_8b_moe_teacher.yaml": {"teacher.ep": "2"},
    # SFT: no teacher as shipped (`teacher: {path: ''}`): keep it so.
    "real/sft.yaml": {"teacher.path": None},
}


@pytest.fixture(scope="module")
def qwen3_models(tmp_path_factory):
    """{models}/student (tiny-qwen3), {models}/teacher (tiny-qwen3-moe), {models}/dense_teacher (a second
    tiny-qwen3, seed 1): all over the tiny chat tokenizer."""
    root = tmp_path_factory.mktemp("qwen3")
    make_tiny_qwen3_pair(str(root))
    dense, _ = make_tiny_qwen3_pair(str(root / "dense"), seed=1)
    os.rename(dense, root / "dense_teacher")
    return str(root)


def preset_overrides(preset: str, run: str, qwen3_models: str | None) -> list[str]:
    """The command-line overrides of one case: EVERY, the preset's family, the preset's own."""
    family = preset.split(os.sep)[0]
    if family not in FAMILIES:
        raise AssertionError(
            f"examples/{preset}: no override table for the folder {family!r}: add one to FAMILIES in {__file__}"
        )
    table = {**EVERY, **FAMILIES[family], **PRESET.get(preset, {})}
    models = qwen3_models if family == "qwen3" else TINY_MODELS
    return [
        f"{key}={value.format(run=run, models=models, data=TINY_DATA)}"
        for key, value in table.items()
        if value is not None
    ]


def _steps(run_dir: str) -> dict[int, dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r for r in records if "event" not in r and r.get("step", 0) > 0}


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_trains_two_steps(preset, tmp_path, request):
    qwen3 = request.getfixturevalue("qwen3_models") if preset.startswith("qwen3") else None
    run = str(tmp_path / "run")
    cmd = [
        sys.executable,
        "-m",
        "megaopd.cli",
        "train",
        os.path.join(EXAMPLES, preset),
        *preset_overrides(preset, run, qwen3),
    ]
    t0 = time.time()
    r = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT}
    )
    print(f"{preset}: {time.time() - t0:.1f} s")
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    steps = _steps(run)
    assert sorted(steps) == [1, 2], sorted(steps)
    for step, metrics in steps.items():
        losses = {k: v for k, v in metrics.items() if k.startswith("loss/")}
        assert "loss/total" in losses and all(math.isfinite(v) for v in losses.values()), (step, losses)
