"""The protocol's own rules: per-sample seeds and SamplingParams validation."""

import math

import pytest

from megaopd.rollout.protocol import SamplingParams, derive_seed


def test_seeds():
    assert derive_seed(1, 0, 0) == derive_seed(1, 0, 0)
    assert len({derive_seed(1, i, j) for i in range(10) for j in range(10)}) == 100
    assert 0 <= derive_seed(2**70, 3, 4) < 2**63


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    assert math.isclose(SamplingParams(min_p=0.1).min_p, 0.1)
