"""The fused output layer (megaopd.ops.head) on one set of inputs: run on a rank's vocabulary shard, and the
float64 full-vocabulary formula it must equal (module level so that spawned gloo workers can import it)."""

import io

import torch
import torch.distributed as dist

from megaopd import ops
from megaopd.ops.head import LogitsHead, tokenwise

B, S, H, V_REAL, V_PADDED, K, CHUNK, TAU, BETA = 2, 7, 8, 37, 40, 3, 4, 0.7, 0.3


def inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return {
        "hidden": r(B, S, H) * 2,
        "weight": r(V_PADDED, H),
        "ref_hidden": r(B, S, H) * 2,
        "ref_weight": r(V_PADDED, H),
        "ids": torch.randint(0, V_REAL, (B, S), generator=g),
        "support": torch.rand(B, S, V_REAL, generator=g).argsort(-1)[..., :K],
        "support_ref": -r(B, S, K).abs(),
        "w": r(5, B, S),
    }


def run(rank: int, world_size: int, group, chunk_tokens: int | None = CHUNK) -> dict:
    """Values and gradients on this rank's shard. chunk_tokens None: the materialized logits (today's path)."""
    inp = inputs()
    v = V_PADDED // world_size
    rows = slice(rank * v, (rank + 1) * v)
    hidden = inp["hidden"].clone().requires_grad_()
    weight = inp["weight"][rows].clone().requires_grad_()
    head = LogitsHead(hidden, weight, V_REAL, group, chunk_tokens or 1)
    ref = LogitsHead(inp["ref_hidden"], inp["ref_weight"][rows], V_REAL, group, chunk_tokens or 1)
    if chunk_tokens is None:
        head, ref = head.materialize(), ref.materialize()
    kw = dict(group=group, temperature=TAU)
    logprobs, kl, entropy = tokenwise(
        lambda z, ids, q: ops.vocab_parallel_logprobs_kl(z, ids, q, with_entropy=True, overwrite_q=True, **kw),
        head,
        inp["ids"],
        ref.detach(),
    )
    support_kl = tokenwise(
        lambda z, ids, lq: ops.vocab_parallel_support_kl(z, ids, lq, **kw), head, inp["support"], inp["support_ref"]
    )
    jsd = tokenwise(lambda z, q: ops.vocab_parallel_jsd(z, q, BETA, **kw), head, ref.detach())
    topk_lp, topk_ids = tokenwise(lambda z: ops.vocab_parallel_topk(z, K, **kw), head.detach())
    w = inp["w"]
    loss = (w[0] * logprobs + w[1] * kl + w[2] * support_kl + w[3] * jsd).sum()
    loss.backward()
    grad_hidden = hidden.grad.clone()
    if group is not None:  # megatron's TP region op sums the ranks' partial input gradients
        dist.all_reduce(grad_hidden, group=group)
    return {
        "logprobs": logprobs.detach(),
        "kl": kl.detach(),
        "entropy": entropy,
        "support_kl": support_kl.detach(),
        "jsd": jsd.detach(),
        "topk_logprobs": topk_lp,
        "topk_ids": topk_ids,
        "grad_hidden": grad_hidden,
        "grad_weight": weight.grad,
    }


def reference() -> dict:
    """The float64 formula on the whole vocabulary (values and gradients of the differentiable terms)."""
    inp = inputs()
    hidden = inp["hidden"].clone().requires_grad_()
    weight = inp["weight"].clone().requires_grad_()

    def logp(h, W):
        z = (h @ W.t())[..., :V_REAL] / TAU
        return torch.log_softmax(z, dim=-1)

    lp, lq = logp(hidden, weight), logp(inp["ref_hidden"], inp["ref_weight"])
    p, q = lp.exp(), lq.exp()
    logprobs = lp.gather(-1, inp["ids"][..., None])[..., 0]
    kl = (p * (lp - lq)).sum(-1)
    entropy = -(p * lp).sum(-1)
    m = BETA * q + (1 - BETA) * p
    jsd = BETA * (q * (lq - m.log())).sum(-1) + (1 - BETA) * (p * (lp - m.log())).sum(-1)
    log_pi = lp.gather(-1, inp["support"])  # renormalized over the support (LSM)
    log_pihat = log_pi - log_pi.logsumexp(-1, keepdim=True)
    log_qhat = inp["support_ref"] - inp["support_ref"].logsumexp(-1, keepdim=True)
    support_kl = (log_pihat.exp() * (log_pihat - log_qhat)).sum(-1)
    topk_logprobs, topk_ids = lp.topk(K, dim=-1)
    w = inp["w"]
    loss = (w[0] * logprobs + w[1] * kl + w[2] * support_kl + w[3] * jsd).sum()
    loss.backward()
    return {
        "logprobs": logprobs.detach(),
        "kl": kl.detach(),
        "entropy": entropy.detach(),
        "support_kl": support_kl.detach(),
        "jsd": jsd.detach(),
        "topk_logprobs": topk_logprobs.detach(),
        "topk_ids": topk_ids,
        "grad_hidden": hidden.grad,
        "grad_weight": weight.grad,
    }


def worker(rank, world_size):
    group = dist.new_group(ranks=list(range(world_size)))
    out = {"chunked": run(rank, world_size, group), "whole": run(rank, world_size, group, None)}
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def load(payload: bytes):
    return torch.load(io.BytesIO(payload), weights_only=True)
