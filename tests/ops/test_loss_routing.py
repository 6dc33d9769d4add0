"""LossInputs routes stable_opd (and any sum with an exact ref_kl) through the fused
ops.vocab_parallel_logprobs_kl: one call per micro-batch, and the same loss, metrics and gradient as the
unfused ops (LossInputs.fuse_reference=False). The float64 references of the losses are tests/losses.

    pytest tests/ops/test_loss_routing.py -x
"""

import pytest
import torch

from megaopd import ops
from megaopd.losses import LossInputs, build_loss

B, T, V = 2, 9, 50


def _inputs(fuse, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.8).float()
    return LossInputs(
        logits_BTv=logits,
        token_ids_BT=ids,
        loss_mask_BT=mask,
        temperature=0.9,
        fuse_reference=fuse,
        old_logprobs_BT=-torch.rand(B, T, generator=g) * 4,
        teacher_logprobs_BT=-torch.rand(B, T, generator=g) * 4,
        ref_logits_BTv=(logits.detach().float() + torch.randn(B, T, V, generator=g)).to(dtype),
        golden_logits_BTv=logits,
        golden_ids_BT=ids,
        golden_mask_BT=mask,
    )


CONFIGS = [
    ("stable_opd", {"sft_weight": 0.5, "ref_kl_weight": 0.3}),
    ("stable_opd", {"opd": {"log_entropy": False}}),
    ("weighted_sum", {"terms": [{"name": "ref_kl", "weight": 0.2}, {"name": "opd"}]}),  # KL asked first
    ("weighted_sum", {"terms": [{"name": "opd"}, {"name": "ref_kl", "config": {"estimator": "k3"}}]}),
]


@pytest.mark.parametrize("name,config", CONFIGS)
def test_fused_routing_matches_unfused(name, config, monkeypatch):
    loss_fn = build_loss(name, config)
    calls = []
    fused_op = ops.vocab_parallel_logprobs_kl
    monkeypatch.setattr(ops, "vocab_parallel_logprobs_kl", lambda *a, **k: calls.append(1) or fused_op(*a, **k))
    results = []
    for fuse in (True, False):
        inputs = _inputs(fuse)
        result = loss_fn(inputs)
        loss, metrics = result.total, result.metrics
        loss.backward()
        results.append((loss.detach(), metrics, inputs.logits_BTv.grad))
        assert len(calls) == 1  # one fused call with fuse_reference, none without
    (loss_f, metrics_f, grad_f), (loss_u, metrics_u, grad_u) = results
    torch.testing.assert_close(loss_f, loss_u)
    assert metrics_f.keys() == metrics_u.keys()
    for key in metrics_f:
        torch.testing.assert_close(metrics_f[key], metrics_u[key], msg=key)
    torch.testing.assert_close(grad_f, grad_u)


def test_entropy_asked_under_no_grad_does_not_cache_graphless_logprobs():
    inputs = _inputs(True)
    with torch.no_grad():
        inputs.student_entropy()
    assert inputs.student_logprobs().requires_grad and inputs.student_ref_kl("ref_kl").requires_grad
