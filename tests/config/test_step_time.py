"""`megaopd plan --step-time` (megaopd/config/step_time.py): the phase formulas by hand on Qwen2.5-7B's dims,
the modes' composition, the choice of the engine/trainer split, and the command's table."""

import dataclasses
import math
import os

import pytest

from megaopd.config.plan_config import StepTimeConfig
from megaopd.config.step_time import StepShape, generate_s, predict, score_and_train_s, step_times
from megaopd.metrics.flops import MatmulDims
from megaopd.models.hf_config import read_hf_config
from tests.config.test_plan import Q7B, _cli, _write_preset


def _shape(rows=256, prompt=256, response=4096, longest=8192, golden=64, teacher=True):
    hf = read_hf_config(os.path.join(Q7B, "config.json"))
    dims = MatmulDims.of(hf)
    return StepShape(
        rows,
        prompt,
        response,
        longest,
        golden,
        dims,
        dims if teacher else None,
        dims,
        weight_bytes=2.0 * 7_615_616_512,
        kv_bytes_per_token=2.0 * 2 * 28 * 4 * 128,
        trainer_gpus_min=2,
    )


def test_predict_composes_the_phases_per_mode():
    assert predict("sync", 9.7, 2.38, 0.02) == pytest.approx(12.10)
    assert predict("one_step_off", 9.7, 2.38, 0.02) == pytest.approx(9.72)  # generation-bound: the rest hides
    assert predict("async", 9.7, 2.38, 0.02) == pytest.approx(9.70)  # and the push too
    assert predict("one_step_off", 1.0, 3.0, 0.5) == pytest.approx(3.5)  # trainer-bound
    assert predict("async", 1.0, 3.0, 0.5) == pytest.approx(3.5)
    with pytest.raises(ValueError, match="rollout.mode"):
        predict("fast", 1, 1)


def test_generation_by_hand_the_longest_response_bounds_it():
    r, w = StepTimeConfig(), _shape()
    # 4 engine GPUs, tp 1: 64 rows each. Reading 15.23 GB of weights 8192 times at 4.3 TB/s x 0.5 beats
    # computing 64 rows x 4096 tokens x 2N at 989 TFLOP/s x 0.15.
    bw, flops, n = 4.3e12 * 0.5, 989e12 * 0.15, w.student.params
    weights = 8192 * 2.0 * 7_615_616_512 / bw
    assert weights > 64 * 4096 * 2.0 * n / flops
    kv = 64 * 57_344 * (256 * 4096 + 4096**2 / 2) / bw
    prefill = 64 * (2.0 * n * 256 + 2.0 * 28 * 3584 * 256**2) / flops
    assert generate_s(w, r, 4) == pytest.approx(weights + kv + prefill)
    # More engines shorten the batch's share, never the longest response's decode steps.
    assert generate_s(w, r, 256) > weights
    assert generate_s(w, r, 256) < generate_s(w, r, 4)


def test_scoring_and_training_by_hand():
    r, w = StepTimeConfig(), _shape()
    n, attn = w.student.params, 2.0 * 28 * 3584
    s = 256 + 4096
    score_flops = 2 * 256 * (2.0 * n * s + attn * s * s)  # the actor's and the in-job teacher's forward
    train_flops = 3 * (256 + 64) * (2.0 * n * s + attn * s * s)  # 6N per trained token, golden rows included
    score, train = score_and_train_s(w, r, 8)
    assert score == pytest.approx(score_flops / (8 * 989e12 * 0.15))
    assert train == pytest.approx(train_flops / (8 * 989e12 * 0.11))
    served = _shape(teacher=False)  # a served teacher scores elsewhere
    assert score_and_train_s(served, r, 8)[0] == pytest.approx(score / 2)
    # A teacher shown a golden solution in front of the problem scores rows a response longer.
    privileged = dataclasses.replace(w, teacher_context_tokens=4096)
    t = s + 4096
    teacher_flops = 256 * (2.0 * n * t + attn * t * t)
    assert score_and_train_s(privileged, r, 8)[0] == pytest.approx(
        (score_flops / 2 + teacher_flops) / (8 * 989e12 * 0.15)
    )


def test_split_layouts_pick_the_best_engine_share():
    r, w = StepTimeConfig(), _shape()
    t = step_times(w, r, nodes=2)
    assert set(t) == {"sync colocated", "sync split", "one_step_off split", "async split"}
    g = 8
    for key, mode in (("sync split", "sync"), ("one_step_off split", "one_step_off"), ("async split", "async")):
        c = t[key]
        assert (g - c.engine_gpus) % w.trainer_gpus_min == 0 and 0 < c.engine_gpus < g
        push = w.weight_bytes / 25e9  # engines on the other node
        for e in range(1, g):  # no other split is faster
            if (g - e) % 2 == 0:
                assert c.seconds <= predict(mode, generate_s(w, r, e), sum(score_and_train_s(w, r, g - e)), push) + 1e-9
    assert t["async split"].seconds <= t["one_step_off split"].seconds <= t["sync split"].seconds
    assert math.isclose(
        t["sync colocated"].seconds, generate_s(w, r, g) + sum(score_and_train_s(w, r, g)) + w.weight_bytes / 100e9
    )


def test_engine_weights_count_every_expert_of_a_moe_model():
    from types import SimpleNamespace

    from megaopd.models.hf_config import padded_vocab_size, params_per_rank

    hf = SimpleNamespace(
        hidden_size=8,
        head_dim=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_layers=3,
        vocab_size=100,
        num_experts=16,
        moe_topk=2,
        moe_intermediate_size=4,
        intermediate_size=0,
        tie_word_embeddings=False,
        qkv_bias=False,
    )
    dims = MatmulDims.of(hf)  # the top-2 experts a token runs
    attn, router = 8 * (8 + 2 * 4) + 8 * 8, 16 * 8
    assert dims.params == 3 * (attn + 2 * 3 * 8 * 4 + router) + 100 * 8
    # What shape_for pushes and reads per decode step: every expert, both norms, the padded vocabulary twice
    # (embedding and output layer) and the final norm.
    assert (
        params_per_rank(hf, 1, 1)
        == 3 * (attn + 16 * 3 * 8 * 4 + router + 2 * 8) + 2 * padded_vocab_size(100, 1) * 8 + 8
    )


def test_rates_are_checked():
    with pytest.raises(ValueError, match="train_mfu"):
        StepTimeConfig(train_mfu=1.5)
    with pytest.raises(ValueError, match="nodes"):
        StepTimeConfig(nodes=[0])


def test_plan_command_prints_the_step_time_table(tmp_path):
    preset = _write_preset(tmp_path)
    out = _cli(
        "plan",
        "--step-time",
        preset,
        "student.recompute=full",
        "optimizer.use_distributed_optimizer=true",
        "plan.step_time.nodes=[1,4]",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| nodes | GPUs | sync colocated | sync split | one_step_off | async |" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| 1 |", "| 4 |"))]
    assert len(rows) == 2 and "E=" in rows[1]
    assert "fits: peak" in out.stdout
