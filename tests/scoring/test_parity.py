"""The weight-sync parity statistics: a tight float32 bound; in bf16, statistics that pass a correct
sync (bf16 rounding of the logits) and fail a broken one (weights of another model)."""

import torch

from megaopd.scoring import bounds_for, parity_report

BOUNDS = dict(max_abs=1e-3, mean_abs=0.05, p99_abs=0.5, min_correlation=0.9)


def _logprobs(logits_TV, ids_T):
    return torch.log_softmax(logits_TV.double(), -1).gather(-1, ids_T[:, None])[:, 0]


def test_float32_bound_is_tight():
    lp = [[-0.5, -1.25, -3.0]]
    ok = parity_report([[v + 1e-6 for v in lp[0]]], lp)
    assert not ok.violations(bounds_for("float32", **BOUNDS))
    bad = parity_report([[v + 2e-3 for v in lp[0]]], lp)
    assert bad.violations(bounds_for("float32", **BOUNDS))


def test_bf16_statistics_pass_rounding_and_fail_a_broken_sync():
    g = torch.Generator().manual_seed(0)
    T, V = 2048, 1000
    logits = torch.randn(T, V, generator=g) * 6  # |logit| up to ~25: bf16 ulps of 0.125 there
    ids = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0]
    actor = _logprobs(logits, ids)
    engine_ok = _logprobs(logits.bfloat16().float(), ids)
    ok = parity_report([engine_ok.tolist()], [actor.tolist()])
    assert ok.max_abs > 1e-3  # the float32 bound would have refused a correct bf16 sync
    assert not ok.violations(bounds_for("bfloat16", **BOUNDS)), ok.line()
    other = torch.randn(T, V, generator=g) * 6  # a stale or garbled model
    broken = parity_report([_logprobs(other, ids).tolist()], [actor.tolist()])
    assert broken.violations(bounds_for("bfloat16", **BOUNDS)), broken.line()
