"""loss.off_policy_correction (losses/off_policy.py) against float64 references written from its docstring:
the weights themselves, and the opd / grpo losses' values and gradients with each correction."""

import math

import pytest
import torch
import torch.nn.functional as F

from megaopd.losses import LossConfig, LossInputs, OffPolicyCorrection, build_loss_from
from megaopd.losses.off_policy import correction_weights, mis_weights, tis_weights
from tests.losses import _reference as R
from tests.losses import _workers as W


def _engine_lp(batch, spread=0.8, seed=7):
    """Engine log-probs a stale policy might give: log pi_old plus noise wide enough to cross [1/C, C]."""
    g = torch.Generator().manual_seed(seed)
    return batch["old_lp"] + spread * torch.randn(batch["old_lp"].shape, generator=g, dtype=torch.float64)


def test_weights_match_their_definitions_and_never_overflow():
    old = torch.tensor([0.0, -1.0, -3.0, -0.5, -900.0], dtype=torch.float64)
    eng = torch.tensor([0.0, -0.2, -0.1, -2.0, -0.1], dtype=torch.float64)
    C = 2.0
    ratio = [math.exp(o - e) for o, e in zip(old.tolist(), eng.tolist())]
    w, bound = tis_weights(old, eng, C)
    assert w.tolist() == pytest.approx([min(r, C) for r in ratio], rel=1e-12, abs=1e-300)
    assert bound.tolist() == [r > C for r in ratio]
    w, out = mis_weights(old, eng, C)
    assert w.tolist() == [1.0 if 1 / C <= r <= C else 0.0 for r in ratio]
    assert out.tolist() == [not (1 / C <= r <= C) for r in ratio]
    huge, _ = tis_weights(torch.tensor([0.0]), torch.tensor([-1e4]), 3.0)  # exp(1e4) would be inf
    assert float(huge) == pytest.approx(3.0)
    assert correction_weights(OffPolicyCorrection("recompute"), old, None) == (None, None)
    with pytest.raises(ValueError, match="engine_logprobs_BT"):
        correction_weights(OffPolicyCorrection("tis"), old, None)


def _reference_opd(batch, engine_lp, method, C, eps=0.2):
    """Token-mean PPO-clip OPD with the correction, literally, in float64; returns (loss, grad of logits)."""
    logits = batch["logits"].clone().requires_grad_(True)
    logp = F.log_softmax(logits, -1).gather(-1, batch["ids"][..., None])[..., 0]
    old, q, mask = batch["old_lp"], batch["teacher_lp"], batch["mask"]
    total, n = 0.0, 0
    for b, t in mask.bool().nonzero().tolist():
        baseline = logp[b, t].detach() if method == "recompute" else old[b, t]
        adv = q[b, t] - baseline
        rho = torch.exp(logp[b, t] - old[b, t])
        l_t = -torch.minimum(rho * adv, torch.clamp(rho, 1 - eps, 1 + eps) * adv)
        r = math.exp(float(old[b, t] - engine_lp[b, t]))
        w = {"none": 1.0, "recompute": 1.0, "tis": min(r, C), "mis": 1.0 if 1 / C <= r <= C else 0.0}[method]
        total, n = total + w * l_t, n + 1
    loss = total / n
    loss.backward()
    return loss.detach(), logits.grad


@pytest.mark.parametrize("method", ["none", "tis", "mis", "recompute"])
def test_opd_with_each_correction_matches_float64_reference(method):
    batch = R.make_batch(seed=1)
    engine_lp = _engine_lp(batch)
    C = 1.5
    loss_fn = build_loss_from(
        LossConfig(name="opd", config={"log_entropy": False}, off_policy_correction=method, off_policy_clip=C)
    )
    assert loss_fn.needs.engine_logprobs == (method in ("tis", "mis"))
    inputs, logits, _ = W.build_inputs(batch, None, 0, 1, torch.float64, engine_logprobs_BT=engine_lp)
    result = loss_fn(inputs)
    loss, metrics = result.total, result.metrics
    loss.backward()
    want_loss, want_grad = _reference_opd(batch, engine_lp, method, C)
    assert float(loss.detach()) == pytest.approx(float(want_loss), rel=1e-5, abs=1e-7)
    assert torch.allclose(logits.grad, want_grad, rtol=1e-5, atol=1e-7)
    if method in ("tis", "mis"):
        on = batch["mask"].bool()
        ratio = torch.exp(batch["old_lp"] - engine_lp)[on]
        w = ratio.clamp(max=C) if method == "tis" else ((ratio >= 1 / C) & (ratio <= C)).double()
        bound = ratio > C if method == "tis" else (ratio < 1 / C) | (ratio > C)
        assert 0 < float(bound.double().mean()) < 1, "the batch should exercise the bound"
        assert float(metrics["off_policy/weight_mean"]) == pytest.approx(float(w.mean()), rel=1e-6)
        assert float(metrics["off_policy/weight_max"]) == pytest.approx(float(w.max()), rel=1e-6)
        assert float(metrics["off_policy/clip_frac"]) == pytest.approx(float(bound.double().mean()), rel=1e-6)
    else:
        assert not any(k.startswith("off_policy/") for k in metrics)


def test_recompute_equals_none_where_the_student_has_not_moved():
    """With pi_theta = pi_old (the first mini-batch of a step) recompute equals none (the reference test above
    covers where they part)."""
    batch = R.make_batch(seed=1)
    logp = R.ref_logprobs(batch["logits"], batch["ids"], 1.0)
    out = {}
    for method in ("none", "recompute"):
        inputs, _, _ = W.build_inputs(batch, None, 0, 1, torch.float64, old_logprobs_BT=logp)
        out[method] = float(
            build_loss_from(LossConfig(name="opd", off_policy_correction=method))(inputs).total.detach()
        )
    assert out["none"] == pytest.approx(out["recompute"], rel=1e-6)  # ops compute in float32


def test_stable_opd_and_grpo_take_the_correction_through_their_terms():
    batch = R.make_batch(seed=1)
    engine_lp = _engine_lp(batch)
    inputs, _, _ = W.build_inputs(batch, None, 0, 1, torch.float64, engine_logprobs_BT=engine_lp)
    m = build_loss_from(LossConfig(name="stable_opd", off_policy_correction="mis"))(inputs).metrics
    assert "off_policy/weight_mean" in m and 0 < float(m["off_policy/weight_mean"]) < 1
    inputs, _, _ = W.build_inputs(batch, None, 0, 1, torch.float64, engine_logprobs_BT=engine_lp)
    plain = float(build_loss_from(LossConfig(name="grpo"))(inputs).total.detach())
    inputs, _, _ = W.build_inputs(batch, None, 0, 1, torch.float64, engine_logprobs_BT=engine_lp)
    tis = float(
        build_loss_from(LossConfig(name="grpo", off_policy_correction="tis", off_policy_clip=1e9))(
            inputs
        ).total.detach()
    )
    assert tis != pytest.approx(plain)  # the importance weights reach grpo's tokens


def test_bad_corrections_fail_at_build_time():
    with pytest.raises(ValueError, match="off_policy_correction='vtrace'"):
        build_loss_from(LossConfig(name="opd", off_policy_correction="vtrace"))
    with pytest.raises(ValueError, match="off_policy_clip=0.5"):
        build_loss_from(LossConfig(name="opd", off_policy_correction="tis", off_policy_clip=0.5))
    with pytest.raises(ValueError, match="has no such term"):
        build_loss_from(LossConfig(name="sft", off_policy_correction="tis"))
    with pytest.raises(ValueError, match="reverse-KL reward of opd"):
        build_loss_from(LossConfig(name="grpo", off_policy_correction="recompute"))
    assert isinstance(LossInputs, type)


def test_auto_correction_is_tis_where_rollouts_lag_and_a_policy_term_exists():
    """loss.off_policy_correction=auto (the default), as the job config resolves it when it loads."""
    from megaopd.config.schema import MegaOPDConfig
    from megaopd.losses import resolve_correction
    from megaopd.rollout.config import RolloutConfig

    assert resolve_correction(LossConfig(), lagged=False) == "none"
    assert resolve_correction(LossConfig(), lagged=True) == "tis"  # stable_opd: opd's policy term
    assert resolve_correction(LossConfig(name="grpo"), lagged=True) == "tis"
    assert resolve_correction(LossConfig(name="sft"), lagged=True) == "none"  # nothing to weight
    assert resolve_correction(LossConfig(off_policy_correction="mis"), lagged=False) == "mis"  # given: kept
    remote = RolloutConfig(engine="remote", urls=["http://h:1"], mode="async", max_staleness=2)
    assert MegaOPDConfig(rollout=remote).loss.off_policy_correction == "tis"
    assert MegaOPDConfig().loss.off_policy_correction == "none"
