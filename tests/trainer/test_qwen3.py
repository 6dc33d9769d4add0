"""Qwen3 in the trainer: a tiny Stable-OPD run with a Qwen3 student and a Qwen3-MoE teacher at expert
parallelism 2 (finite losses, engine/actor log-prob gap of the synced embedded engine < 1e-3), and a
Qwen3-MoE student whose one training step (router auxiliary loss on) gives the same gradient at EP=2 as at
EP=1 over the same two data-parallel ranks (expert gradients reduced over the expert data-parallel group)."""

import math

import pytest

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from megaopd.parallel.launch import spawn
from tests.trainer import _workers
from tests.trainer.test_layouts import tiny_overrides
from tests.trainer.tiny_models import ROOT, make_tiny_qwen3_pair

STABLE_OPD = f"{ROOT}/examples/tiny/stable_opd.yaml"


def _small(overrides):
    """The layout test's tiny run without the preset's TP=2 student."""
    return overrides + [
        "run.world_size=2",
        "student.tp=1",
        "reference.tp=1",
        "teacher.tp=1",
        "validation.path=''",
        "trainer.save_interval=100",
    ]


@pytest.mark.slow
def test_stable_opd_qwen3_student_moe_teacher_ep2(tmp_path):
    student, teacher = make_tiny_qwen3_pair(str(tmp_path / "models"))
    cfg = load_config(
        MegaOPDConfig, STABLE_OPD, _small(tiny_overrides(tmp_path, student, teacher, "qwen3")) + ["teacher.ep=2"]
    )
    (metrics,) = spawn(_workers.run_presets, 2, args=([cfg],), timeout=1500)[0]
    assert math.isfinite(metrics["loss/total"]) and math.isfinite(metrics["loss/opd"]), metrics
    assert math.isfinite(metrics["rollout/teacher_logprob_mean"])
    assert metrics["train/grad_norm"] > 0
    assert metrics["sync/logprob_gap_max"] < 1e-3, metrics["sync/logprob_gap_max"]


@pytest.mark.slow
def test_moe_student_gradient_equal_at_ep1_and_ep2(tmp_path):
    student, teacher = make_tiny_qwen3_pair(str(tmp_path / "models"), student_moe=True)
    results = {}
    for ep in (1, 2):
        overrides = _small(tiny_overrides(tmp_path, student, teacher, f"ep{ep}"))
        # EP > 1 runs the padded path (EP ranks exchange tokens in lockstep): compare EP layouts on that path
        # (packed rows route no padding tokens, so the router's aux loss differs from the padded one's).
        cfg = load_config(
            MegaOPDConfig,
            STABLE_OPD,
            overrides + [f"student.ep={ep}", f"reference.ep={ep}", f"teacher.ep={ep}", "trainer.pack_sequences=false"],
        )
        results[ep] = spawn(_workers.one_step_gradients, 2, args=(cfg,), timeout=1500)[0]
    ref, got = results[1], results[2]
    assert ref["grad_norm"] > 0 and math.isfinite(ref["loss"])
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert set(got["grads"]) == set(ref["grads"])
    routers = [n for n in ref["grads"] if n.endswith("mlp.gate.weight")]
    assert routers and all(float(ref["grads"][n].abs().max()) > 0 for n in routers)  # the router trains
    for hf_name, g in ref["grads"].items():
        diff = float((got["grads"][hf_name] - g).abs().max())
        assert diff <= 1e-5 * max(1.0, float(g.abs().max())), (hf_name, diff)
