"""Rollout metrics against hand computations."""

import random
import string
import zlib

import pytest
import torch

from megaopd.metrics import (
    RepetitionConfig,
    advantage_split,
    compression_ratio,
    is_repetitive,
    repetition_rate,
    repetitive_token_flags,
    repetitive_token_mask,
    response_metrics,
    rollout_dynamics,
    truncation_rate,
)


def test_truncation_rate():
    assert truncation_rate(["stop", "length", "length", "abort"]) == 0.5
    assert truncation_rate([]) == 0.0
    assert truncation_rate(["stop"]) == 0.0


def test_compression_ratio_by_hand():
    text = "ab" * 500
    b = text.encode()
    assert compression_ratio(text) == len(b) / len(zlib.compress(b, 9))
    assert compression_ratio("") == 0.0
    # Non-ASCII: the ratio is of bytes, not characters.
    t = "é" * 100
    assert compression_ratio(t) == 200 / len(zlib.compress(t.encode(), 9))


def _prose(n, seed=0):
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters + "     ") for _ in range(n))


def test_repetition_threshold_and_length():
    cfg = RepetitionConfig(window_chars=1000, ratio_threshold=10.0)
    loop = "Wait, let me recompute. " * 100  # 2400 chars
    assert compression_ratio(loop[-1000:]) > 10
    assert is_repetitive(loop, cfg)
    # Exactly L characters: not longer than L, so not repetitive however compressible.
    assert not is_repetitive(loop[:1000], cfg)
    assert is_repetitive(loop[:1001], cfg)
    # Random text compresses < 2x.
    prose = _prose(3000)
    assert compression_ratio(prose[-1000:]) < 2
    assert not is_repetitive(prose, cfg)
    # Only the tail counts: prose followed by a 1000-char loop is repetitive; a loop followed by prose is not.
    assert is_repetitive(prose + loop[:1000], cfg)
    assert not is_repetitive(loop + prose, cfg)
    assert repetition_rate([loop, prose, "short", loop], cfg) == 0.5
    assert repetition_rate([], cfg) == 0.0
    # Paper defaults: L = 10000.
    assert RepetitionConfig().window_chars == 10000 and RepetitionConfig().ratio_threshold == 10
    assert not is_repetitive(loop)  # 2400 chars < 10000
    assert is_repetitive(loop * 5)


def test_response_metrics_keys():
    m = response_metrics(["a" * 2000, "b"], ["length", "stop"], RepetitionConfig(window_chars=1000), prefix="val")
    assert m == {"val/truncation_rate": 0.5, "val/repetition_rate": 0.5}
    with pytest.raises(ValueError):
        response_metrics(["a"], [], prefix="val")


def test_repetitive_token_flags_by_hand():
    # n = 3: the 3-gram (1,2,3) ends at t=2 and again at t=5; (2,3,1)/(3,1,2) are new at t=3,4.
    ids = [1, 2, 3, 1, 2, 3, 4]
    assert repetitive_token_flags(ids, n=3) == [False, False, False, False, False, True, False]
    # Overlapping occurrences: a run of one token, n = 2: (7,7) first ends at 1, repeats from 2.
    assert repetitive_token_flags([7, 7, 7, 7], n=2) == [False, False, True, True]
    # n = 1: every repeat of a token id.
    assert repetitive_token_flags([5, 6, 5, 5], n=1) == [False, False, True, True]
    assert repetitive_token_flags([1, 2], n=8) == [False, False]
    assert repetitive_token_flags([], n=8) == []


def test_repetitive_token_mask_padded():
    # Row 0: prompt [9, 9] then response [1,2,1,2,1]; row 1: response [4,4,4] then padding.
    ids = torch.tensor([[9, 9, 1, 2, 1, 2, 1], [4, 4, 4, 0, 0, 0, 0]])
    resp = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    m = repetitive_token_mask(ids, resp, n=2)
    # Row 0 response 2-grams ending at 1..4: (1,2) (2,1) (1,2)* (2,1)*; prompt 9,9 is not part of it.
    assert m.tolist() == [
        [False, False, False, False, False, True, True],
        [False, False, True, False, False, False, False],
    ]


def test_advantage_split_by_hand():
    adv = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 100.0]])
    rep = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)  # the 100 is padding
    m = advantage_split(adv, rep, mask)
    # repetitive masked: 2, 3, 6 -> mean 11/3, 3 of 7 tokens; regular: 1, 4, 5, 0 -> 10/4.
    assert m["adv/repetitive_mean"] == pytest.approx(11 / 3)
    assert m["adv/regular_mean"] == pytest.approx(2.5)
    assert m["adv/repetitive_share"] == pytest.approx(3 / 7)
    assert m["adv/regular_share"] == pytest.approx(4 / 7)
    empty = advantage_split(adv, torch.zeros_like(rep), mask)
    assert empty["adv/repetitive_mean"] == 0.0 and empty["adv/repetitive_share"] == 0.0


def test_rollout_dynamics_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    s = torch.tensor([[-1.0, -2.0, -50.0], [-3.0, -4.0, -5.0]])
    t = torch.tensor([[-2.0, -2.0, 9.0], [-2.0, -2.0, -2.0]])
    m = rollout_dynamics([2, 3], mask, s, t, t - s)
    assert m["rollout/response_length_mean"] == 2.5
    assert m["rollout/student_logprob_mean"] == pytest.approx(-15 / 5)
    assert m["rollout/teacher_logprob_mean"] == pytest.approx(-2.0)
    assert m["rollout/advantage_mean"] == pytest.approx(1.0)
    assert set(rollout_dynamics([1], mask)) == {"rollout/response_length_mean"}
