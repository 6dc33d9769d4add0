"""The ops never hold a full [T, V] float tensor beyond the logits and their gradient.

Two single-process checks per differentiable op:
  - saved tensors (torch.autograd.graph.saved_tensors_hooks): nothing with T*V elements is saved for
    backward except the input logits themselves (same storage);
  - allocations (torch.profiler, CPU memory per op): with bf16 logits, the only allocations of
    [T, V] size are the gradients (bf16), one per differentiable input; everything else is a
    [chunk, V] float32 buffer, far smaller. A float32 [T, V] softmax would be twice a gradient's size.

    pytest tests/ops/test_memory.py -x
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megaopd import ops

T, V, CHUNK = 256, 1000, 16


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    p = (torch.randn(T, V, generator=g) * 3).to(dtype).requires_grad_()
    q = (torch.randn(T, V, generator=g) * 3).to(dtype).requires_grad_()
    ids = torch.randint(0, V, (T,), generator=g)
    support = torch.stack([torch.randperm(V, generator=g)[:8] for _ in range(T)])
    ref = torch.log_softmax(torch.randn(T, 8, generator=g), -1)
    return p, q, ids, support, ref


OPS = {  # name -> (fn(p, q, ids, support, ref), number of differentiable logits inputs)
    "logprobs": (lambda p, q, ids, s, r: ops.vocab_parallel_logprobs(p, ids, chunk_size=CHUNK), 1),
    "logsumexp": (lambda p, q, ids, s, r: ops.vocab_parallel_logsumexp(p, chunk_size=CHUNK), 1),
    "entropy": (lambda p, q, ids, s, r: ops.vocab_parallel_entropy(p, chunk_size=CHUNK), 1),
    "kl": (lambda p, q, ids, s, r: ops.vocab_parallel_kl(p, q, chunk_size=CHUNK), 2),
    "jsd": (lambda p, q, ids, s, r: ops.vocab_parallel_jsd(p, q, 0.5, chunk_size=CHUNK), 2),
    "support_kl": (lambda p, q, ids, s, r: ops.vocab_parallel_support_kl(p, s, r), 1),
    # Fused log-probs + KL to a frozen q (+ entropy): ONE gradient buffer for both differentiable outputs.
    "logprobs_kl": (
        lambda p, q, ids, s, r: sum(
            ops.vocab_parallel_logprobs_kl(p, ids, q.detach(), chunk_size=CHUNK, with_entropy=True)
        ),
        1,
    ),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_backward_saves_no_full_vocab_tensor_but_the_logits(name):
    fn, _ = OPS[name]
    p, q, ids, support, ref = _inputs(torch.float32)
    inputs = {p.untyped_storage().data_ptr(), q.untyped_storage().data_ptr()}
    saved = []

    def pack(t):
        saved.append((t.numel(), t.dtype, t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(p, q, ids, support, ref)
    big = [(n, dt) for n, dt, ptr in saved if n >= T * V and ptr not in inputs]
    assert not big, f"{name} saves full-vocabulary tensors for backward: {big}"
    out.sum().backward()  # the saved state suffices


@pytest.mark.parametrize("name", sorted(OPS))
def test_peak_allocations_are_chunks_and_gradients(name):
    fn, num_grads = OPS[name]
    p, q, ids, support, ref = _inputs(torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(p, q, ids, support, ref)
        out.sum().backward()
    allocs = sorted(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    grad_bytes = T * V * 2  # one bf16 [T, V] gradient
    large = [a for a in allocs if a > grad_bytes // 8]  # a float32 [chunk, V] buffer is grad_bytes / 8
    if name == "support_kl":  # only the student gets a gradient: q is unused
        num_grads = 1
    assert large == [grad_bytes] * num_grads, (
        f"{name}: allocations above chunk size {large}; expected only {num_grads} gradient(s) of {grad_bytes} bytes"
    )


def test_forward_without_grad_allocates_only_chunks():
    p, q, ids, _, _ = _inputs(torch.bfloat16)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ops.vocab_parallel_logprobs(p, ids, chunk_size=CHUNK)
        ops.vocab_parallel_kl(p, q, chunk_size=CHUNK)
        ops.vocab_parallel_jsd(p, q, 0.3, chunk_size=CHUNK)
        ops.vocab_parallel_topk(p, 5, chunk_size=CHUNK)
        ops.vocab_parallel_logprobs_kl(p, ids, q, chunk_size=CHUNK, with_entropy=True)
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    assert largest <= CHUNK * V * 4, f"largest allocation {largest} bytes exceeds one float32 chunk"


def _lp_kl(p, ids, q, **kw):
    """A scalar of both differentiable outputs, with per-token weights (distinct upstream gradients)."""
    lp, kl, _ = ops.vocab_parallel_logprobs_kl(p, ids, q, chunk_size=CHUNK, **kw)
    w = torch.linspace(0.5, 1.5, lp.numel())
    return (w * lp).sum() + 0.1 * (w.flip(0) * kl).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_backward_can_take_q_memory_for_the_gradient(dtype):
    """overwrite_q (the trainer's lockstep reference logits, dropped after backward): the gradient is written
    into q's buffer, bit for bit the gradient of the default path, and no [T, V] gradient buffer is made."""
    p, q, ids, _, _ = _inputs(dtype)
    q = q.detach()
    expected = torch.autograd.grad(_lp_kl(p, ids, q), p)[0]
    q_ptr, seen = q.untyped_storage().data_ptr(), []
    p.register_hook(lambda g: seen.append(g.untyped_storage().data_ptr()))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = _lp_kl(p, ids, q, overwrite_q=True)
        (grad,) = torch.autograd.grad(out, p)
    assert seen == [q_ptr]  # the gradient reached p in q's memory
    assert torch.equal(grad, expected)
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    assert largest < T * V * q.element_size(), f"a [T, V] buffer of {largest} bytes was allocated"
    # q in another dtype than p: a gradient buffer of p's dtype after all, q left as it was
    q32 = q.float()
    before = q32.clone()
    grad32 = torch.autograd.grad(_lp_kl(p, ids, q32, overwrite_q=True), p)[0]
    if dtype != torch.float32:
        assert torch.equal(q32, before) and grad32.dtype == dtype
