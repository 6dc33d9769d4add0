"""Top-k overlap and the collapse detector against hand computations."""

import math

import pytest
import torch

from megaopd.metrics import CollapseConfig, CollapseDetector, RateThresholds, ResponseRates, topk_overlap
from megaopd.metrics.collapse import watched


def _rates(trunc: float = 0.0, rep: float = 0.0) -> ResponseRates:
    return ResponseRates(truncation_rate=trunc, repetition_rate=rep)


def test_topk_overlap_by_hand():
    # k = 4, two tokens. Token 0 shares {1, 3} (student probs 0.4, 0.1); token 1 shares all four.
    s_ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    s_p = torch.tensor([[0.4, 0.3, 0.1, 0.05], [0.5, 0.2, 0.1, 0.1]])
    t_ids = torch.tensor([[3, 9, 1, 10], [8, 7, 6, 5]])
    hs, ht = torch.tensor([1.0, 2.0]), torch.tensor([1.5, 0.5])
    m = topk_overlap(s_ids, s_p.log(), t_ids, student_entropy_T=hs, teacher_entropy_T=ht)
    assert m["overlap/ratio"] == pytest.approx((2 / 4 + 4 / 4) / 2)
    assert m["overlap/mass"] == pytest.approx((0.5 + 0.9) / 2)
    assert m["overlap/entropy_gap"] == pytest.approx((0.5 + 1.5) / 2)
    # The mask drops token 1.
    m = topk_overlap(s_ids, s_p.log(), t_ids, torch.tensor([True, False]))
    assert m["overlap/ratio"] == pytest.approx(0.5) and m["overlap/mass"] == pytest.approx(0.5)
    assert "overlap/entropy_gap" not in m


def test_topk_overlap_batched_shapes_and_errors():
    s_ids = torch.arange(12).reshape(2, 2, 3)  # [B, T, K]
    m = topk_overlap(s_ids, torch.full((2, 2, 3), math.log(0.2)), s_ids.flip(-1), torch.ones(2, 2, dtype=torch.bool))
    assert m["overlap/ratio"] == pytest.approx(1.0) and m["overlap/mass"] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="same k"):
        topk_overlap(s_ids, s_ids.float(), s_ids[..., :2])


def test_collapse_detector_jump_level_and_once_per_episode():
    cfg = CollapseConfig(window=4, min_history=3, repetition_rate=RateThresholds(jump=0.1, level=0.5))
    cfg.truncation_rate = RateThresholds()  # unwatched: neither alarm
    det = CollapseDetector(cfg)
    assert det.update(0, _rates(rep=0.0)) == []
    assert det.update(1, _rates(rep=0.3)) == []  # too little history for a jump, below the level
    assert det.update(2, _rates(trunc=1.0, rep=0.0)) == []  # truncation is not watched
    w = det.update(3, _rates(rep=0.3))  # baseline (0 + 0.3 + 0) / 3 = 0.1; 0.3 - 0.1 = 0.2 > 0.1
    assert len(w) == 1 and w[0].reason == "jump" and w[0].baseline == pytest.approx(0.1) and w[0].step == 3
    assert w[0].metric == "repetition_rate" and "step 3" in w[0].message and det.alarmed
    assert det.update(4, _rates(rep=0.9)) == []  # still in the same episode
    # Window [0.3, 0, 0.3, 0.9], mean 0.375: 0.3 is below both thresholds, the episode ends.
    assert det.update(5, _rates(rep=0.3)) == []
    assert not det.alarmed
    assert det.update(6, _rates(rep=0.45)) == []  # window [0, 0.3, 0.9, 0.3] mean 0.375: +0.075, no jump
    w = det.update(7, _rates(rep=0.55))  # window [0.3, 0.9, 0.3, 0.45] mean 0.4875: +0.0625, but > level 0.5
    assert [x.reason for x in w] == ["level"]
    assert "truncation_rate" not in det.state_dict()["history"]


def test_every_watched_rate_has_its_thresholds_under_its_name():
    """ResponseRates' fields, CollapseConfig's RateThresholds fields and the detector's watched list agree."""
    from dataclasses import fields

    rates = [f.name for f in fields(ResponseRates)]
    thresholds = [
        f.name for f in fields(CollapseConfig) if isinstance(getattr(CollapseConfig(), f.name), RateThresholds)
    ]
    assert rates == thresholds == [name for name, _, _ in watched(_rates(), CollapseConfig())]
    values = ResponseRates(truncation_rate=0.25, repetition_rate=0.75)
    assert [v for _, v, _ in watched(values, CollapseConfig())] == [0.25, 0.75]


def test_collapse_detector_state_dict_roundtrip():
    cfg = CollapseConfig(window=3, min_history=2)
    a, b = CollapseDetector(cfg), CollapseDetector(cfg)
    seq = [0.01, 0.02, 0.03, 0.4, 0.6, 0.7, 0.02, 0.01, 0.5]
    for s, x in enumerate(seq[:5]):
        a.update(s, _rates(x, x / 2))
    b.load_state_dict(a.state_dict())
    for s, x in enumerate(seq[5:], start=5):
        wa = a.update(s, _rates(x, x / 2))
        wb = b.update(s, _rates(x, x / 2))
        assert wa == wb
    assert a.state_dict() == b.state_dict()
    assert [w.metric for w in a.warnings][:2] == ["truncation_rate", "repetition_rate"]


def test_collapse_config_validation():
    with pytest.raises(ValueError, match="min_history"):
        CollapseConfig(window=2, min_history=3)
    with pytest.raises(ValueError, match=r"metrics.collapse.repetition_rate.level=-0.5 must be >= 0"):
        CollapseConfig(repetition_rate=RateThresholds(level=-0.5))


def test_no_collapse_warning_before_a_baseline():
    """A short token budget truncates most responses from step 1 (SmolLM2-135M at 96 tokens): that is where
    the run starts, not a collapse. One quiet note says so; a real rise later is still warned about."""
    det = CollapseDetector(CollapseConfig())  # min_history 3, level truncation 0.5
    (note,) = det.update(1, _rates(0.9))
    assert (note.reason, note.is_collapse, note.event, note.baseline, note.history) == (
        "no_baseline",
        False,
        "collapse_no_baseline",
        None,
        0,
    )
    assert "no baseline yet (0 earlier steps)" in note.message and "rollout.max_new_tokens" in note.message
    assert not note.message.startswith("collapse warning")
    for step in range(2, 7):  # high from the start and staying there: nothing more, baseline or not
        assert det.update(step, _rates(0.9)) == []
    for step in range(7, 12):
        assert det.update(step, _rates(0.1)) == []
    (w,) = det.update(12, _rates(0.8))  # falls back, then rises: collapse
    assert (w.is_collapse, w.event, w.history) == (True, "collapse_warning", 10)
    assert w.message.startswith("collapse warning at step 12: truncation_rate = 0.800")
    assert "baseline over the last 10 steps" in w.message


def test_no_baseline_note_of_a_metric_without_a_hint():
    cfg = CollapseConfig(min_history=2, truncation_rate=RateThresholds(), repetition_rate=RateThresholds(level=0.2))
    det = CollapseDetector(cfg)
    assert det.update(1, _rates(rep=0.1)) == []
    (note,) = det.update(2, _rates(rep=0.5))
    assert note.reason == "no_baseline" and "(1 earlier steps)" in note.message and "max_new_tokens" not in note.message
    det.update(3, _rates(rep=0.1))
    assert [w.reason for w in det.update(4, _rates(rep=0.6))] == ["level"]  # a baseline now


def test_warnings_saved_before_the_no_baseline_fields_load():
    det = CollapseDetector()
    det.load_state_dict(
        {
            "history": {"truncation_rate": [0.1, 0.2]},
            "alarmed": {"truncation_rate": True},
            "warnings": [{"step": 4, "metric": "truncation_rate", "value": 0.7, "baseline": 0.1, "reason": "level"}],
        }
    )
    assert det.warnings[0].is_collapse and det.warnings[0].history == 0 and det.alarmed
    # The loaded window is the baseline the typed rates are measured against: [0.1, 0.2, 0.1] mean 0.1333.
    assert det.update(5, _rates(0.1)) == [] and not det.alarmed
    (w,) = det.update(6, _rates(0.4))  # 0.4 - 0.1333 > jump 0.2
    assert (w.reason, w.history, w.baseline) == ("jump", 3, pytest.approx(0.4 / 3))
