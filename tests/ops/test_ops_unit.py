"""Single-process properties of megaopd.ops beyond the reference comparison in test_vocab_parallel.py:
identities between the ops, limits, edge cases, extreme magnitudes and argument checks.

    pytest tests/ops/test_ops_unit.py -x
"""

import pytest
import torch

from megaopd import ops


def _logits(*shape, scale=1.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def test_vocab_range_is_megatrons_contiguous_sharding():
    assert ops.vocab_range(17, 0) == (0, 17)
    assert ops.vocab_range(17, 3) == (51, 68)


def test_group_none_never_touches_torch_distributed(monkeypatch):
    """group=None is one process with the whole vocabulary, never a lookup of a global group."""
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("torch.distributed called with group=None")

    for name in ("all_reduce", "all_gather", "get_rank", "get_world_size", "new_group"):
        monkeypatch.setattr(dist, name, refuse)
    p, q = _logits(3, 10, seed=9).requires_grad_(), _logits(3, 10, seed=10)
    ids = torch.tensor([1, 2, 3])
    total = (
        ops.vocab_parallel_logprobs(p, ids)
        + ops.vocab_parallel_entropy(p)
        + ops.vocab_parallel_kl(p, q)
        + ops.vocab_parallel_jsd(p, q, 0.5)
        + ops.vocab_parallel_logsumexp(p)
        + ops.vocab_parallel_support_kl(p, ids[:, None].expand(3, 2), torch.zeros(3, 2))
        + sum(x for x in ops.vocab_parallel_logprobs_kl(p, ids, q, with_entropy=True))
    )
    total.sum().backward()
    ops.vocab_parallel_topk(p, 4)


def test_jsd_tends_to_the_kls_its_limits_return():
    """JSD(beta) ~ beta KL(q||p) as beta -> 0 and ~ (1 - beta) KL(p||q) as beta -> 1, which is why
    beta = 0 returns KL(q||p) and beta = 1 returns KL(p||q) (TRL's convention)."""
    p, q = _logits(7, 30, scale=2.0, seed=1), _logits(7, 30, scale=2.0, seed=2)
    forward_kl, reverse_kl = ops.vocab_parallel_jsd(p, q, 0.0), ops.vocab_parallel_jsd(p, q, 1.0)
    errors = []
    for eps in (1e-2, 1e-3, 1e-4):
        errors.append(
            max(
                float(((ops.vocab_parallel_jsd(p, q, eps) / eps - forward_kl) / forward_kl).abs().max()),
                float(((ops.vocab_parallel_jsd(p, q, 1 - eps) / eps - reverse_kl) / reverse_kl).abs().max()),
            )
        )
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-2, errors
    torch.testing.assert_close(ops.vocab_parallel_jsd(p, q, 0.0), ops.vocab_parallel_kl(q, p))
    torch.testing.assert_close(ops.vocab_parallel_jsd(p, q, 1.0), ops.vocab_parallel_kl(p, q))


def test_support_kl_over_the_whole_vocabulary_is_the_full_kl():
    p, q = _logits(2, 5, 24, seed=3).requires_grad_(), _logits(2, 5, 24, seed=4)
    support = torch.arange(24).expand(2, 5, 24)
    ref = torch.log_softmax(q / 0.9, -1) + 3.0  # any normalization: renormalized over the support
    kl_s = ops.vocab_parallel_support_kl(p, support, ref, temperature=0.9)
    kl_f = ops.vocab_parallel_kl(p, q, temperature=0.9)
    torch.testing.assert_close(kl_s, kl_f, rtol=1e-5, atol=1e-6)
    (g_s,) = torch.autograd.grad(kl_s.sum(), p)
    (g_f,) = torch.autograd.grad(kl_f.sum(), p)
    torch.testing.assert_close(g_s, g_f, rtol=1e-4, atol=1e-6)


def test_support_kl_gradient_only_at_support_ids_and_empty_support_is_zero():
    p = _logits(4, 40, seed=5).requires_grad_()
    ids = torch.tensor([[3, 9, 27], [0, 1, 39], [5, -1, 7], [-1, -1, -1]])
    mask = ids >= 0
    ref = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, -4.0], [-1.0, float("nan"), -2.0], [float("nan")] * 3])
    kl = ops.vocab_parallel_support_kl(p, ids, ref, support_mask=mask)
    assert torch.isfinite(kl).all() and kl[3] == 0
    (grad,) = torch.autograd.grad(kl.sum(), p)
    assert torch.isfinite(grad).all()
    touched = torch.zeros_like(grad, dtype=torch.bool)
    touched[torch.arange(4)[:, None].expand_as(ids)[mask], ids[mask]] = True
    assert (grad[~touched] == 0).all() and (grad[touched] != 0).any()
    assert (grad.sum(-1).abs() < 1e-6).all()  # renormalized: shifting all support logits changes nothing


def test_topk_ties_within_one_shard_give_distinct_ids_with_the_tied_values():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0, 5.0, 0.0]])
    logprobs, ids = ops.vocab_parallel_topk(logits, 4)
    assert sorted(ids[0, :3].tolist()) == [1, 2, 4] and ids[0, 3].item() == 3
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(-1, ids))
    assert not logprobs.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_magnitudes_stay_finite(dtype):
    """Logits around +-3e4 with a small temperature (|z| ~ 6e5): no overflow, no NaN, float32 out."""
    p = (_logits(9, 50, scale=1e4, seed=6) + 2e4).to(dtype).requires_grad_()
    q = (_logits(9, 50, scale=1e4, seed=7) - 2e4).to(dtype).requires_grad_()
    ids = torch.randint(0, 50, (9,))
    outs = [
        ops.vocab_parallel_logprobs(p, ids, temperature=0.05, chunk_size=2),
        ops.vocab_parallel_logsumexp(p, temperature=0.05),
        ops.vocab_parallel_entropy(p, temperature=0.05),
        ops.vocab_parallel_kl(p, q, temperature=0.05),
        ops.vocab_parallel_jsd(p, q, 0.5, temperature=0.05),
        ops.vocab_parallel_support_kl(p, torch.arange(6).expand(9, 6), torch.zeros(9, 6), temperature=0.05),
        sum(ops.vocab_parallel_logprobs_kl(p, ids, q.detach(), temperature=0.05, chunk_size=4)[:2]),
    ]
    for out in outs:
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        grads = torch.autograd.grad(out.sum(), [p, q], allow_unused=True)
        for g in grads:
            assert g is None or (g.dtype == dtype and torch.isfinite(g).all())
    lp, _ = ops.vocab_parallel_topk(p, 3, temperature=0.05)
    assert torch.isfinite(lp).all()


def test_noncontiguous_and_empty_inputs():
    logits = _logits(6, 4, 20, seed=8).transpose(0, 1)  # [4, 6, 20], not contiguous
    ids = torch.randint(0, 20, (4, 6))
    want = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None])[..., 0].float()
    torch.testing.assert_close(ops.vocab_parallel_logprobs(logits, ids, chunk_size=5), want)
    empty = torch.zeros(0, 3, 20, requires_grad=True)
    out = ops.vocab_parallel_kl(empty, empty.detach())
    assert out.shape == (0, 3)
    out.sum().backward()
    assert empty.grad.shape == empty.shape
    empty.grad = None
    lp, kl, ent = ops.vocab_parallel_logprobs_kl(
        empty, torch.zeros(0, 3, dtype=torch.long), empty.detach(), with_entropy=True
    )
    assert lp.shape == kl.shape == ent.shape == (0, 3)
    (lp.sum() + kl.sum()).backward()
    assert empty.grad.shape == empty.shape


def test_bad_arguments_raise_with_the_fix():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="temperature"):
        ops.vocab_parallel_logprobs(x, torch.zeros(3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="ids has leading shape"):
        ops.vocab_parallel_logprobs(x, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="same shape"):
        ops.vocab_parallel_kl(x, torch.zeros(3, 9))
    with pytest.raises(ValueError, match="beta"):
        ops.vocab_parallel_jsd(x, x, 1.5)
    with pytest.raises(ValueError, match="k="):
        ops.vocab_parallel_topk(x, 9)
    with pytest.raises(ValueError, match="chunk_size"):
        ops.vocab_parallel_entropy(x, chunk_size=0)
    with pytest.raises(ValueError, match="same shape"):
        ops.vocab_parallel_logprobs_kl(x, torch.zeros(3, dtype=torch.long), torch.zeros(3, 9))
    with pytest.raises(ValueError, match="detach"):
        ops.vocab_parallel_logprobs_kl(x, torch.zeros(3, dtype=torch.long), x.clone().requires_grad_())
    with pytest.raises(ValueError, match="support_logprobs_ref"):
        ops.vocab_parallel_support_kl(x, torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_logprobs_kl_outputs_and_gradient_dtype(dtype):
    """Entropy only on request and never differentiable; one gradient, in the logits' dtype, equal to
    the sum of the unfused ops' gradients."""
    p = _logits(2, 7, 40, scale=3.0, seed=11, dtype=dtype).requires_grad_()
    q = _logits(2, 7, 40, scale=3.0, seed=12, dtype=dtype)
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    lp, kl, ent = ops.vocab_parallel_logprobs_kl(p, ids, q, temperature=1.2, chunk_size=3)
    assert ent is None and lp.dtype == kl.dtype == torch.float32 and lp.shape == kl.shape == (2, 7)
    (grad,) = torch.autograd.grad((lp * 0.7 + kl * 1.3).sum(), p)
    assert grad.dtype == dtype
    (want,) = torch.autograd.grad(
        (
            ops.vocab_parallel_logprobs(p, ids, temperature=1.2) * 0.7
            + ops.vocab_parallel_kl(p, q, temperature=1.2) * 1.3
        ).sum(),
        p,
    )
    # bf16: the unfused gradients are rounded to bf16 twice (each op's, then their sum), the fused once.
    tol = {} if dtype == torch.float32 else dict(rtol=0.0, atol=2**-7 * float(want.abs().max()))
    torch.testing.assert_close(grad, want, **tol)
    with torch.no_grad():
        _, _, ent = ops.vocab_parallel_logprobs_kl(p, ids, q, temperature=1.2, with_entropy=True)
    torch.testing.assert_close(ent, ops.vocab_parallel_entropy(p.detach(), temperature=1.2))


def test_fused_logprobs_kl_same_without_the_cpu_matmul_shortcut():
    """At reduced float32 matmul precision the fused op sums with multiply + sum instead of bmm."""
    p, q = _logits(5, 60, scale=4.0, seed=13), _logits(5, 60, scale=4.0, seed=14)
    ids = torch.arange(5)
    want = ops.vocab_parallel_logprobs_kl(p, ids, q, with_entropy=True)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        got = ops.vocab_parallel_logprobs_kl(p, ids, q, with_entropy=True)
    finally:
        torch.set_float32_matmul_precision(previous)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
