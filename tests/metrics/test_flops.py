"""megaopd.metrics.flops against FLOPs counted by hand for Qwen2.5-1.5B (tests/config/fixtures): h=1536,
12 heads of 128, 2 KV heads, FFN 8960, 28 layers, vocab 151936 (tied: the output layer counts once)."""

import os

import pytest

from megaopd.metrics.flops import MatmulDims, StepWork, peak_tflops, step_flops
from megaopd.models.hf_config import read_hf_config

Q15B = os.path.join(os.path.dirname(os.path.dirname(__file__)), "config", "fixtures", "qwen2.5-math-1.5b")


def test_matmul_params_and_forward_by_hand():
    d = MatmulDims.of(read_hf_config(Q15B))
    h, q, kv, f, L, V = 1536, 1536, 256, 8960, 28, 151936
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f  # qkv, o, gate/up/down
    assert d.params == L * per_layer + V * h and d.output_params == V * h
    assert d.attn_dim == 1536 and d.layers == 28
    s = 1000  # one causal sequence: 2N per token + QK^T and AV over half the s x s scores
    assert d.forward([s]) == 2 * d.params * s + 2 * L * q * s * s


def test_step_model_and_hardware_flops():
    d = MatmulDims.of(read_hf_config(Q15B))
    S = [300, 700]
    fwd, tokens = d.forward(S), sum(S)
    base = StepWork(d, S, actor_scored_S=S, teacher=d, teacher_scored_S=S)
    f = step_flops(base)
    assert f.model_train == f.hardware_train == pytest.approx(3 * fwd)  # 6N per trained token + attention
    assert f.model == pytest.approx(3 * fwd + 2 * fwd)  # + 2N per scored token, actor and teacher
    # full recomputation: one more forward of the layers (not the output layer); the lockstep reference's
    # forward; the fused output layer's chunk logits again, for both models
    g = step_flops(StepWork(d, S, partner=d, recompute="full", fused_head=True))
    assert g.model_train == pytest.approx(3 * fwd)
    extra = (fwd - 2 * d.output_params * tokens) + fwd + 2 * (2 * d.output_params * tokens)
    assert g.hardware_train == pytest.approx(3 * fwd + extra)
    sel = step_flops(StepWork(d, S, recompute="selective"))
    assert sel.hardware_train - sel.model_train == pytest.approx(d.attention_forward(S))


def test_peak_of_known_gpus_only():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops(None) is None and peak_tflops("Some GPU") is None
