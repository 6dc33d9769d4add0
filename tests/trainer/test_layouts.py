"""One training step of Stable-OPD (OPD + golden SFT + exact reference KL in lockstep) gives the same
actor gradient, gathered to HF names, in every parallel layout: TP=1, TP=2, PP=2, and DP=2 with the
teacher at TP=2 over the same ranks (its own process groups)."""

import os

import pytest

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from megaopd.parallel.launch import spawn
from tests.trainer import _workers
from tests.trainer.tiny_models import DATA, make_tiny_pair

LAYOUTS = {
    "tp1": (1, []),
    "tp2": (2, ["student.tp=2", "reference.tp=2"]),
    "pp2": (2, ["student.pp=2", "reference.pp=2"]),
    "dp2_teacher_tp2": (2, ["teacher.tp=2"]),
}


def tiny_overrides(tmp_path, student, teacher, name):
    return [
        f"student.path={student}",
        f"teacher.path={teacher}",
        f"run.dir={tmp_path / name}",
        "trainer.max_steps=2",
        "trainer.prompts_per_step=4",
        "trainer.samples_per_prompt=2",
        "trainer.micro_batch_size=2",
        "trainer.eval_interval=0",
        "optimizer.lr=1e-4",
        "rollout.max_new_tokens=16",
        f"data.sources=[{{path: {os.path.join(DATA, 'opd.jsonl')}, max_rows: 32}}]",
        "data.max_prompt_len=128",
        "data.max_golden_len=128",
        "metrics.repetition.window_chars=50",
        "loss.mask_first_tokens=['<think>', '<|im_end|>']",
        "logging.tensorboard=false",
    ]


@pytest.mark.slow
def test_gradient_equal_across_layouts(tmp_path):
    student, teacher = make_tiny_pair(str(tmp_path / "models"))
    results = {}
    for name, (world, layout) in LAYOUTS.items():
        cfg = load_config(
            MegaOPDConfig, None, tiny_overrides(tmp_path, student, teacher, name) + [f"run.world_size={world}", *layout]
        )
        results[name] = spawn(_workers.one_step_gradients, world, args=(cfg,))[0]
    ref = results["tp1"]
    assert ref["grad_norm"] > 0
    for name, got in results.items():
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), name
        # The norm checks megatron's view of the gradient (TP duplicates, DP sums), not only ours.
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), name
        for hf_name, g in ref["grads"].items():
            diff = float((got["grads"][hf_name] - g).abs().max())
            assert diff <= 1e-6 * max(1.0, float(g.abs().max())), (name, hf_name, diff)
