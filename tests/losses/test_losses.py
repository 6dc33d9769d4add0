"""Every loss against its float64 full-vocabulary reference (tests/losses/_reference.py): values and
gradients w.r.t. the student (and golden) logits, at TP = 1 (in-process), 2 and 4 (spawned gloo workers),
on random, large-magnitude, masked, ragged and packed batches; aggregation exact under micro-batching and
data parallelism; metrics; configs.

    pytest tests/losses -x              # all (about a minute on 2 cores)
    pytest tests/losses -x -m "not slow"
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from megaopd.parallel.launch import spawn
from tests.losses import _reference as R
from tests.losses import _workers as W

# float32 code (megaopd.ops computes and returns float32 whatever the input dtype) vs the float64
# reference: the "large" batch has logits ~ 700 +- 170 after the temperature, where float32 itself is
# only good to ~5e-5 absolute.
TOL = {"float32": dict(rtol=2e-4, atol=2e-5)}
TOL_LARGE32 = dict(rtol=2e-3, atol=2e-4)


@functools.lru_cache(maxsize=None)
def _batches():
    return {name: R.make_batch(**kw) for name, kw in R.BATCHES.items()}


@functools.lru_cache(maxsize=None)
def _reference(label: str, batch_name: str):
    for lab, bname, name, cfg in R.CASES:
        if (lab, bname) == (label, batch_name):
            return R.reference_value_and_grads(_batches()[bname], name, cfg)
    raise KeyError(label)


def _as_torch(obj):
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _as_torch(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_as_torch(v) for v in obj)
    return obj


def _check(results_by_rank: list[dict], dtype: str):
    """Concatenates the ranks' gradient shards along the vocabulary and compares with the reference."""
    results_by_rank = [_as_torch(r) for r in results_by_rank]
    failures = []
    for label, batch_name, _, _ in R.CASES:
        key = (label, batch_name)
        ref_loss, ref_grad, ref_golden = _reference(label, batch_name)
        tol = TOL_LARGE32 if (dtype == "float32" and batch_name == "large") else TOL[dtype]
        losses = [r[key][0] for r in results_by_rank]
        grad = torch.cat([r[key][1] for r in results_by_rank], dim=-1)
        golden = [r[key][2] for r in results_by_rank]
        golden = torch.zeros_like(ref_golden) if golden[0] is None else torch.cat(golden, dim=-1)
        for rank_loss in losses:
            if not math.isclose(rank_loss, ref_loss, rel_tol=tol["rtol"], abs_tol=tol["atol"]):
                failures.append(f"{key}: loss {rank_loss} vs reference {ref_loss}")
        for what, got, want in (("grad", grad, ref_grad), ("golden grad", golden, ref_golden)):
            if not torch.allclose(got, want, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, float(want.abs().max()))):
                failures.append(
                    f"{key}: {what} max diff {float((got - want).abs().max()):.3g} "
                    f"(max |ref| {float(want.abs().max()):.3g})"
                )
        # Metrics are replicated over TP ranks (they come from full-vocabulary quantities).
        for name, value in results_by_rank[0][key][3].items():
            for r in results_by_rank[1:]:
                if not math.isclose(r[key][3][name], value, rel_tol=1e-5, abs_tol=1e-6):
                    failures.append(f"{key}: metric {name} differs across TP ranks")
    for batch_name, batch in _batches().items():
        for r in results_by_rank:
            if not torch.equal(r[("student_topk_ids", batch_name)], batch["s_topk_ids"]):
                failures.append(f"student_topk_support ids differ from the reference top-k on {batch_name}")
    assert not failures, "\n".join(failures)


def test_tp1_values_and_grads_match_float64_reference():
    _check([W.run_cases(None, 0, 1, "float32")], "float32")


@pytest.mark.slow
def test_tp2_values_grads_and_dp_aggregation():
    results = spawn(W.tp_worker, world_size=2, args=("float32",))
    _check([r["tp"] for r in results], "float32")
    for key, (diff, scale) in results[0]["dp"].items():
        assert diff <= 1e-5 * max(1.0, scale), f"DP=2 gradient differs for {key}: {diff}"


@pytest.mark.slow
def test_tp4_values_and_grads():
    results = spawn(W.tp_worker, world_size=4, args=("float32",))
    _check([r["tp"] for r in results], "float32")


def test_micro_batches_give_the_one_batch_gradient():
    for key, (grad_diff, loss_diff, scale) in W.micro_batch_diffs().items():
        # float32 ops: exact up to rounding (an off-by-a-count error would be >= 1e-2 relative).
        assert grad_diff <= 1e-5 * max(1.0, scale), f"{key}: grad diff {grad_diff}"
        assert abs(loss_diff) <= 1e-5, f"{key}: loss diff {loss_diff}"


# ------------------------------------------------------------------------------------------------ metrics
def test_opd_metrics_match_hand_computation():
    from megaopd.losses import build_loss

    batch = _batches()["base"]
    inputs, _, _ = W.build_inputs(batch, None, 0, 1, torch.float64)
    m = build_loss("opd", {})(inputs).metrics
    on = batch["mask"].bool()
    logp = R.ref_logprobs(batch["logits"], batch["ids"], 1.0)
    adv = batch["teacher_lp"] - batch["old_lp"]
    ratio = torch.exp(logp - batch["old_lp"])
    clipped = ((ratio > 1.2) & (adv > 0)) | ((ratio < 0.8) & (adv < 0))
    lp_full = torch.log_softmax(batch["logits"], -1)
    entropy = -(lp_full.exp() * lp_full).sum(-1)
    want = {
        "opd/advantage_mean": adv[on].mean(),
        "opd/reward_mean": adv[on].mean(),
        "opd/ratio_mean": ratio[on].mean(),
        "opd/ratio_max": ratio[on].max(),
        "opd/clip_frac": clipped[on].double().mean(),
        "opd/entropy": entropy[on].mean(),
        "opd/student_logprob_mean": logp[on].mean(),
        "opd/teacher_logprob_mean": batch["teacher_lp"][on].mean(),
        "opd/num_tokens": on.sum(),
    }
    assert 0 < float(want["opd/clip_frac"]) < 1, "the batch should exercise the clip"
    for name, value in want.items():
        assert math.isclose(float(m[name]), float(value), rel_tol=2e-6, abs_tol=1e-7), name  # float32 ops


def test_weighted_sum_metrics_are_namespaced_by_label():
    from megaopd.losses import build_loss

    batch = _batches()["base"]
    inputs, _, _ = W.build_inputs(batch, None, 0, 1, torch.float64)
    loss_fn = build_loss(
        "weighted_sum",
        {
            "terms": [
                {"name": "lsm", "config": {"k": 5}, "label": "lsm_teacher"},
                {"name": "lsm", "weight": 0.5, "config": {"support": "student_topk", "k": 4}, "label": "lsm_student"},
            ]
        },
    )
    r = loss_fn(inputs)
    assert {"lsm_teacher/kl", "lsm_student/kl"} <= set(r.metrics) and list(r.terms) == ["lsm_teacher", "lsm_student"]
    assert math.isclose(float(r.total), float(r.terms["lsm_teacher"] + 0.5 * r.terms["lsm_student"]), rel_tol=1e-12)
    single = build_loss("lsm", {"k": 5})(inputs)  # a single loss: the total is its one term, under its name
    assert list(single.terms) == ["lsm"] and float(single.terms["lsm"]) == float(single.total)


def test_stable_opd_zero_weights_need_no_golden_or_reference_inputs():
    from megaopd.losses import build_loss

    batch = _batches()["base"]
    inputs, logits, _ = W.build_inputs(batch, None, 0, 1, torch.float64, golden_logits_BTv=None, ref_logits_BTv=None)
    result = build_loss("stable_opd", {"sft_weight": 0.0, "ref_kl_weight": 0.0})(inputs)
    opd = build_loss("opd", {})(W.build_inputs(batch, None, 0, 1, torch.float64)[0]).total
    assert float(result.total) == pytest.approx(float(opd), rel=1e-12) and list(result.terms) == ["opd"]
    with pytest.raises(ValueError, match="golden_logits_BTv"):
        build_loss("stable_opd", {})(inputs)


# ------------------------------------------------------------------------------------------------ pieces
def test_discounted_returns_and_grpo_advantages():
    from megaopd.losses import discounted_returns, grpo_advantages

    g = torch.Generator().manual_seed(0)
    r = torch.randn(3, 7, generator=g, dtype=torch.float64)
    seq = torch.tensor([[0] * 3 + [1] * 4, [2] * 7, [3] * 2 + [4] * 5])
    for gamma in (0.0, 0.5, 1.0):
        assert torch.allclose(discounted_returns(r, seq, gamma), R.ref_discounted(r, seq, gamma))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5], dtype=torch.float64)
    groups = torch.tensor([3, 3, 3, 7, 7, 9, 3])  # unsorted ids, a zero-variance group, a group of one
    for std_normalize in (True, False):
        got = grpo_advantages(rewards, groups, std_normalize)
        assert torch.allclose(got, R.ref_grpo_adv(rewards, groups, std_normalize), atol=1e-12)
    assert float(grpo_advantages(rewards, groups)[5]) == 0.0


def test_aggregation_handles_nan_at_masked_positions_and_empty_masks():
    from megaopd.losses import aggregate

    loss = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]], requires_grad=True)
    mask = torch.tensor([[1, 0], [1, 0]])
    seq = torch.arange(2)[:, None].expand(2, 2)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        out = aggregate(loss, mask, seq, 2, mode)
        assert float(out) == 2.0
        (g,) = torch.autograd.grad(out, loss)
        assert torch.isfinite(g).all()
        empty = aggregate(loss, torch.zeros_like(mask), seq, 2, mode)
        assert float(empty) == 0.0


def test_first_occurrence_masking():
    from megaopd.losses import mask_first_occurrences

    ids = torch.tensor([[5, 1, 7, 1, 7, 2], [1, 1, 9, 7, 0, 0], [3, 3, 3, 3, 3, 3]])
    mask = torch.tensor(
        [
            [0, 1, 1, 1, 1, 1],  # position 0 (prompt) holds a 5: not a response token
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1],
        ],
        dtype=torch.float32,
    )
    got = mask_first_occurrences(ids, mask, [1, 7, 5])
    want = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.float32)
    assert torch.equal(got, want) and got.dtype == mask.dtype
    assert torch.equal(mask_first_occurrences(ids, mask, []), mask)
    # Packed rows: the first occurrence is per sequence, not per row.
    seq = torch.tensor([[0, 0, 0, 1, 1, 1], [2, 2, 3, 3, 3, 3], [4, 4, 4, 5, 5, 5]])
    for special in ([1], [7], [1, 7], [3], [3, 9, 0]):
        assert torch.equal(
            mask_first_occurrences(ids, mask, special, seq),
            R.reference_first_occurrence_mask(ids, mask, set(special), seq),
        ), special
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        ids = torch.randint(0, 4, (3, 12), generator=g)
        mask = (torch.rand(3, 12, generator=g) > 0.3).long()
        seq = torch.sort(torch.randint(0, 3, (3, 12), generator=g), dim=1).values + torch.arange(3)[:, None] * 3
        assert torch.equal(
            mask_first_occurrences(ids, mask, [0, 2], seq), R.reference_first_occurrence_mask(ids, mask, {0, 2}, seq)
        )
        assert torch.equal(
            mask_first_occurrences(ids, mask, [0, 2]), R.reference_first_occurrence_mask(ids, mask, {0, 2})
        )


def test_configs_reject_bad_values_with_the_fix():
    from megaopd.losses import LossConfig, build_loss, build_loss_from

    for name, cfg, match in [
        ("opd", {"policy_loss": "ppo"}, "policy_loss"),
        ("opd", {"eps_low": 1.0}, "eps_low"),
        ("opd", {"gamma": 2.0}, "gamma"),
        ("opd", {"aggregation": "mean"}, "aggregation"),
        ("opd", {"eps": 0.2}, "accepted: policy_loss"),
        ("ref_kl", {"estimator": "k4"}, "estimator"),
        ("lsm", {"support": "both"}, "support"),
        ("lsm", {"k": 0}, "k=0"),
        ("gkd", {"beta": 1.0}, "beta"),
        ("grpo", {"eps": 0.0}, "eps"),
        ("stable_opd", {"sft_weight": -1.0}, "sft_weight"),
        ("stable_opd", {"opd": {"eps_high": -1}}, "eps_high"),
        ("weighted_sum", {"terms": []}, "no terms"),
        ("weighted_sum", {"terms": [{"name": "nope"}]}, "unknown loss 'nope'"),
        ("weighted_sum", {"terms": [{"name": "opd"}, {"name": "opd"}]}, "label"),
        ("nope", {}, "registered losses"),
    ]:
        with pytest.raises(ValueError, match=match):
            build_loss(name, cfg)
    assert build_loss("lsm", {}).config.k == 32 and build_loss("lsm", {"support": "student_topk"}).config.k == 16
    assert build_loss_from(LossConfig()).name == "stable_opd"
    cfg = build_loss("stable_opd", {}).config
    assert (cfg.sft_weight, cfg.ref_kl_weight, cfg.opd.eps_low, cfg.opd.eps_high) == (0.1, 0.01, 0.2, 0.2)


def test_missing_inputs_name_the_field():
    from megaopd.losses import build_loss

    batch = _batches()["base"]
    inputs, _, _ = W.build_inputs(batch, None, 0, 1, torch.float64, teacher_logprobs_BT=None)
    with pytest.raises(ValueError, match="teacher_logprobs_BT"):
        build_loss("opd", {})(inputs)
    inputs, _, _ = W.build_inputs(batch, None, 0, 1, torch.float64)
    with pytest.raises(ValueError, match="k<=5"):
        build_loss("lsm", {"k": 32})(inputs)


# ------------------------------------------------------------------------------------------------ cross-tokenizer
def test_span_batches_hold_multi_token_spans_and_change_the_loss():
    """The span cases of R.CASES are not vacuous: spans of several tokens, unaligned tokens, and a loss that
    differs from same-tokenizer opd's."""
    from megaopd.losses import build_loss

    for name in ("spans", "spans_packed"):
        batch = _batches()[name]
        on = batch["mask"].bool() & (batch["spans"] >= 0)
        seq = R._seq_ids(batch, 4, 9, batch["seq_ids"])
        keys = [(int(seq[b, t]), int(batch["spans"][b, t])) for b, t in on.nonzero().tolist()]
        assert max(keys.count(k) for k in set(keys)) >= 2 and len(set(keys)) < len(keys)
        assert bool((batch["mask"].bool() & (batch["spans"] < 0)).any())
        with_spans = build_loss("opd", {})(W.build_inputs(batch, None, 0, 1, torch.float64)[0]).total
        without = build_loss("opd", {})(
            W.build_inputs(batch, None, 0, 1, torch.float64, teacher_spans_BT=None)[0]
        ).total
        assert abs(float(with_spans) - float(without)) > 1e-3


@pytest.mark.parametrize("batch_name", ["base", "packed"])
@pytest.mark.parametrize(
    "cfg", [{}, dict(gamma=0.9, policy_loss="importance_sampling", aggregation="seq-mean-token-sum")]
)
def test_one_token_spans_are_same_tokenizer_opd(batch_name, cfg):
    """Every token its own span (a teacher with the student's tokenizer, aligned): the loss, its gradient and
    the advantage metric equal those of spans None, in float64."""
    from megaopd.losses import build_loss

    batch = _batches()[batch_name]
    B, T = batch["mask"].shape
    seq = R._seq_ids(batch, B, T, batch["seq_ids"])
    # Numbered per sequence, from 0: the position within its sequence.
    first = {}
    spans = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            first.setdefault(int(seq[b, t]), t)
            spans[b, t] = t - first[int(seq[b, t])]
    out = []
    for s in (None, spans):
        inputs, logits, _ = W.build_inputs(batch, None, 0, 1, torch.float64, teacher_spans_BT=s)
        result = build_loss("opd", cfg)(inputs)
        loss, m = result.total, result.metrics
        loss.backward()
        out.append((float(loss), logits.grad, float(m["opd/advantage_mean"]), float(m["opd/reward_mean"])))
    (l0, g0, a0, r0), (l1, g1, a1, r1) = out
    assert math.isclose(l0, l1, rel_tol=1e-12, abs_tol=1e-12) and torch.allclose(g0, g1, rtol=1e-12, atol=1e-14)
    assert math.isclose(a0, a1, rel_tol=1e-12) and math.isclose(r0, r1, rel_tol=1e-12)


def test_span_metrics():
    """opd/reward_mean stays the per-token reverse-KL estimate (span rewards summed, over loss tokens);
    opd/unaligned_frac counts loss tokens without a span."""
    from megaopd.losses import build_loss

    batch = _batches()["spans"]
    m = build_loss("opd", {})(W.build_inputs(batch, None, 0, 1, torch.float64)[0]).metrics
    on = batch["mask"].bool()
    valid = on & (batch["spans"] >= 0)
    r = torch.where(valid, batch["teacher_lp"] - batch["old_lp"], torch.zeros_like(batch["old_lp"]))
    assert math.isclose(float(m["opd/reward_mean"]), float(r[on].mean()), rel_tol=1e-6)
    assert math.isclose(float(m["opd/unaligned_frac"]), float((~valid)[on].double().mean()), rel_tol=1e-6)
    adv = R.ref_span_advantages(batch, R._seq_ids(batch, 4, 9, None), 0.0)
    assert math.isclose(float(m["opd/advantage_mean"]), float(adv[on].mean()), rel_tol=1e-6)


@pytest.mark.parametrize(
    "name,cfg,refused",
    [
        ("opd", {}, False),
        ("stable_opd", {}, False),
        ("grpo", {}, False),
        ("sft", {}, False),
        ("ref_kl", {}, False),
        ("gkd", {}, True),
        ("lsm", {}, True),
        ("lsm", {"support": "student_topk"}, True),
        ("weighted_sum", {"terms": [{"name": "opd"}, {"name": "gkd", "weight": 0.5}]}, True),
        ("weighted_sum", {"terms": [{"name": "opd"}, {"name": "gkd", "weight": 0.0}]}, False),
    ],
)
def test_full_distribution_losses_are_refused_cross_tokenizer_in_one_line(name, cfg, refused):
    from megaopd.losses import check_cross_tokenizer

    if not refused:
        check_cross_tokenizer(name, cfg)
        return
    with pytest.raises(ValueError, match=f"loss {name!r} reads the teacher's .* choose loss opd or stable_opd") as e:
        check_cross_tokenizer(name, cfg)
    assert "\n" not in str(e.value)
