"""Packed sequences vs the padded path: one Stable-OPD step (OPD + golden SFT + exact reference KL in
lockstep, teacher at its own TP) on a batch of very uneven lengths gives the same per-token log-probs
(actor and teacher), every loss value and step-wide metric, and the actor's gradient within float32 tolerance,
packed at TP=1, TP=2 (teacher TP=1), PP=2 and DP=2 (teacher TP=2) against the padded path at TP=1.
Packed micro-batches are cut by a small token budget, so a step has several of them, golden rows
packed beside on-policy rows, and the DP shares are balanced by token count.

    pytest tests/trainer/test_packing.py -x
"""

import pytest

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from megaopd.parallel.launch import spawn
from tests.trainer import _workers
from tests.trainer.test_layouts import tiny_overrides
from tests.trainer.tiny_models import make_tiny_pair

PACKED = {
    "packed_tp1": (1, []),
    "packed_tp2": (2, ["student.tp=2", "reference.tp=2"]),
    "packed_pp2": (2, ["student.pp=2", "reference.pp=2"]),
    "packed_dp2_teacher_tp2": (2, ["teacher.tp=2"]),
}
UNEVEN = ["rollout.max_new_tokens=40", "trainer.max_tokens_per_micro_batch=160"]
# Metrics of the whole step: losses (shares of global counts, summed), rollout statistics, grad norm.
STEP_WIDE = ("loss/", "rollout/", "adv/", "overlap/", "sync/", "train/")
REL = 2e-5  # float32: per-sequence attention and other summation orders


@pytest.mark.slow
def test_packed_equals_padded(tmp_path):
    student, teacher = make_tiny_pair(str(tmp_path / "models"))

    def run(name, world, extra):
        cfg = load_config(
            MegaOPDConfig,
            None,
            tiny_overrides(tmp_path, student, teacher, name) + UNEVEN + [f"run.world_size={world}", *extra],
        )
        return spawn(_workers.one_step_everything, world, args=(cfg,))[0]

    ref = run("padded_tp1", 1, ["trainer.pack_sequences=false"])
    assert ref["grad_norm"] > 0
    for name, (world, layout) in PACKED.items():
        got = run(name, world, layout)
        for key in ("actor_logprobs", "teacher_logprobs"):
            diff = float((got[key] - ref[key]).abs().max())
            assert diff < 1e-4, (name, key, diff)
        for key, value in ref["metrics"].items():
            if not key.startswith(STEP_WIDE):
                continue  # a mean over micro-batches of a per-micro-batch value: depends on how the step is cut
            assert got["metrics"][key] == pytest.approx(value, rel=REL, abs=1e-6), (name, key)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL), name
        for hf_name, g in ref["grads"].items():
            diff = float((got["grads"][hf_name] - g).abs().max())
            assert diff <= 1e-5 * max(1.0, float(g.abs().max())), (name, hf_name, diff)
