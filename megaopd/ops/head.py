"""The output layer fused with the per-token ops: logits made a chunk of tokens at a time, never whole.

    head = LogitsHead(hidden_BSH, weight_vH, vocab_size, tp_group, chunk_tokens=1024)
    logprobs_BS = tokenwise(lambda z, ids: vocab_parallel_logprobs(z, ids, tp_group), head, ids_BS)
    logprobs_BS.sum().backward()      # gradients reach hidden_BSH and weight_vH

A LogitsHead is what the model's output layer would have multiplied: this rank's hidden states [..., H]
(the output layer's input, after its tensor-parallel region op) and this rank's vocabulary shard of the
output weight [v, H]. `tokenwise(fn, *args)` runs a per-token op (any function of logits shards and
per-token tensors that returns per-token tensors: the ops of this package, or a closure over several of
them) chunk by chunk: for each chunk of `chunk_tokens` tokens the logits of every head are computed
(chunk @ weight.T, megatron's vocabulary padding masked), `fn` runs on them, its per-token outputs are kept
and the chunk's logits are dropped. The backward recomputes each chunk's logits (and re-runs `fn`, so any
collective inside it runs again, in the same order on every TP rank), backpropagates the outputs'
gradients through `fn` to the chunk's logits, and turns them into the gradients of the hidden states
(g @ W) and of the weight shard (g.T @ h, summed over chunks in float32): Liger's fused linear
cross-entropy and Apple's Cut Cross-Entropy do the same for the SFT loss alone.

Why the seam is here, between "hidden states + weight shard" and "a per-token function of logits": the
losses and the scoring passes already talk to the logits only through per-token ops (LossInputs' cached
quantities, the passes' log-probs / top-k / entropy), so one driver that turns those ops into chunked,
recomputing ones keeps every loss formula as it is, carries the frozen partner's terms (reference KL,
teacher JSD: the partner's head is a second, detached LogitsHead of the same tokens) and works for any op
implementation (torch or Triton: `fn` calls the ops' public functions). The model only stops short of its
output layer (megaopd.models.output_layer.defer_output_layer). When the logits are a plain tensor,
`tokenwise` is just `fn(*args)`: one code path for both.

Memory: per chunk, the chunk's logits per head, the op's own temporaries and, in backward, the logits'
gradient; plus one float32 [v, H] accumulator for the weight's gradient when the weight is 16-bit. Cost: one
extra logits matmul per head and chunk in backward (the recomputation), and `fn`'s forward runs twice.

Legend: T tokens (all leading dimensions flattened), H hidden size, v this rank's vocabulary shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist

# Logit of megatron's vocabulary-padding columns: exp() of it minus any real max is exactly 0, yet it is
# finite, so a shard made only of padding still has a finite local max (-inf - -inf is NaN in the
# log-sum-exp rescaling) and p * log p terms stay 0 * finite (entropy, KL). -1e30 rather than finfo.min,
# which can overflow to -inf once a max is subtracted; float16 (max 65504) gets its own lowest value.
PAD_LOGIT = -1e30

DEFAULT_CHUNK_TOKENS = 1024


def mask_vocab_padding(logits_BSv: torch.Tensor, vocab_size: int, tp_group=None, inplace: bool = False) -> torch.Tensor:
    """This rank's logits shard with megatron's padding columns (global id >= vocab_size) set to
    PAD_LOGIT, so every softmax over the shard ignores them. Returns the input when the shard has no
    padding columns.

    inplace: mask the given tensor itself instead of a masked copy, which would be a second logits-sized
    tensor while the caller still holds the model's output (the pipeline runner does, through the loss). The
    write goes through `.data`, unseen by autograd: recorded, an in-place write on the model's output (a
    transposed view) would cost two logits-sized buffers in backward (CopySlices and the masked gradient),
    and a write through detach() bumps the version a view's grad_fn is replayed from (torch 2.13 crashes in
    register_hook then). A gradient hook zeroes the padding columns of the incoming gradient, as
    masked_fill's backward would. This is sound because nothing saves the model's output for backward
    (megatron's output layer saves its input and weight), and the ops read the logits only after the write."""
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    width = logits_BSv.shape[-1]
    start = tp_rank * width
    if start + width <= vocab_size:
        return logits_BSv
    col = torch.arange(start, start + width, device=logits_BSv.device)
    fill = max(PAD_LOGIT, torch.finfo(logits_BSv.dtype).min)
    padding = col >= vocab_size
    if not inplace:
        return logits_BSv.masked_fill(padding, fill)
    logits_BSv.data.masked_fill_(padding, fill)
    if logits_BSv.requires_grad:
        logits_BSv.register_hook(lambda grad: grad.masked_fill(padding, 0.0))
    return logits_BSv


@dataclass(frozen=True)
class LogitsHead:
    """The logits of some tokens, not yet computed: hidden_BSH @ weight_vH.T, padding columns masked."""

    hidden_BSH: torch.Tensor
    """This rank's hidden states [..., H] at the output layer (after its TP region op: replicated over TP)."""
    weight_vH: torch.Tensor
    """This rank's vocabulary shard of the output weight [v, H] (the parameter itself: tied or not)."""
    vocab_size: int
    """Real vocabulary: logit columns at or past it (megatron's padding) are masked to PAD_LOGIT."""
    tp_group: Any = None
    """The TP group the vocabulary is sharded over (None: one process holds the whole vocabulary)."""
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Tokens whose logits exist at one time."""

    def __post_init__(self):
        if self.hidden_BSH.shape[-1] != self.weight_vH.shape[-1]:
            raise ValueError(
                f"hidden states {tuple(self.hidden_BSH.shape)} and output weight "
                f"{tuple(self.weight_vH.shape)} differ in the hidden size"
            )
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={self.chunk_tokens} must be at least 1")

    @property
    def shape(self) -> torch.Size:
        """The logits' shape [..., v], as the tensor would have."""
        return torch.Size((*self.hidden_BSH.shape[:-1], self.weight_vH.shape[0]))

    @property
    def device(self) -> torch.device:
        return self.hidden_BSH.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weight_vH.dtype

    @property
    def requires_grad(self) -> bool:
        return self.hidden_BSH.requires_grad or self.weight_vH.requires_grad

    def __getitem__(self, index) -> "LogitsHead":
        """The head of some tokens (index the leading dimensions only, e.g. head[:, :-1])."""
        return replace(self, hidden_BSH=self.hidden_BSH[index])

    def detach(self) -> "LogitsHead":
        return replace(self, hidden_BSH=self.hidden_BSH.detach(), weight_vH=self.weight_vH.detach())

    def materialize(self) -> torch.Tensor:
        """The whole logits tensor [..., v] (tests and small inputs only: the point is not to)."""
        logits = torch.matmul(self.hidden_BSH, self.weight_vH.t())
        return mask_vocab_padding(logits, self.vocab_size, self.tp_group)

    def zero(self) -> torch.Tensor:
        """0.0, connected to the hidden states and the weight (a loss whose terms all weigh 0 still backprops)."""
        return self.hidden_BSH.sum() * 0.0 + self.weight_vH.sum() * 0.0


def tokenwise(fn: Callable, *args):
    """fn(*args) where the logits arguments may be LogitsHeads: then chunked over tokens (module docstring).

    args: LogitsHeads or tensors [..., v] of logits, per-token tensors whose leading dimensions are the
    logits' (ids [...], top-k [..., K]) and None. fn returns a per-token tensor, or a tuple of them and
    None. Without any LogitsHead this is fn(*args). Per-token inputs get no gradient (pass them detached);
    every head that requires grad gets one."""
    heads = [a for a in args if isinstance(a, LogitsHead)]
    if not heads:
        return fn(*args)
    lead = heads[0].shape[:-1]
    for a in args:
        got = a.shape[:-1] if isinstance(a, LogitsHead) else a.shape[: len(lead)] if a is not None else lead
        if tuple(got) != tuple(lead):
            raise ValueError(f"tokenwise: an argument has leading shape {tuple(got)}, the logits {tuple(lead)}")
    T = math.prod(lead)
    flat = [_flatten(a, len(lead)) for a in args]
    step = heads[0].chunk_tokens
    chunks = [slice(i, min(i + step, T)) for i in range(0, T, step)] or [slice(0, 0)]
    if not (torch.is_grad_enabled() and any(h.requires_grad for h in heads)):
        with torch.no_grad():
            parts = [_as_tuple(fn(*_chunk_args(flat, sl, grad=False)[1])) for sl in chunks]
        out = tuple(None if parts[0][i] is None else torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))
        return _unflatten(out, lead, single=not isinstance(parts[0], _Multi))
    spec = _Spec(fn, flat, chunks)
    tensors = [
        t
        for a in flat
        for t in ((a.hidden_BSH, a.weight_vH) if isinstance(a, LogitsHead) else (a,) if a is not None else ())
    ]
    outs = _ChunkedLogits.apply(spec, *tensors)
    it = iter(outs)
    out = tuple(None if absent else next(it) for absent in spec.absent)
    return _unflatten(out, lead, single=spec.single)


class _Multi(tuple):
    """fn's outputs when it returned a tuple (a single tensor is wrapped as a plain 1-tuple)."""


def _as_tuple(out) -> tuple:
    return _Multi(out) if isinstance(out, (tuple, list)) else (out,)


def _flatten(a, n_lead: int):
    if isinstance(a, LogitsHead):
        return replace(a, hidden_BSH=a.hidden_BSH.reshape(-1, a.hidden_BSH.shape[-1]))
    if a is None:
        return None
    return a.reshape(-1, *a.shape[n_lead:]).detach()


def _unflatten(out: tuple, lead, single: bool):
    out = tuple(None if o is None else o.view(*lead, *o.shape[1:]) for o in out)
    return out[0] if single else out


def _chunk_logits(head: LogitsHead, sl: slice, grad: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the leaf that receives the gradient or None, the chunk's masked logits [c, v])."""
    with torch.no_grad():
        logits_cV = torch.matmul(head.hidden_BSH[sl].detach(), head.weight_vH.detach().t())
    leaf = logits_cV.requires_grad_() if grad and head.requires_grad else None
    # In place: the leaf's gradient hook zeroes the padding columns, as masked_fill's backward would.
    return leaf, mask_vocab_padding(logits_cV, head.vocab_size, head.tp_group, inplace=True)


def _chunk_args(flat: list, sl: slice, grad: bool):
    leaves, args = [], []
    for a in flat:
        if isinstance(a, LogitsHead):
            leaf, logits = _chunk_logits(a, sl, grad)
            leaves.append(leaf)
            args.append(logits)
        else:
            args.append(None if a is None else a[sl])
    return leaves, args


class _Spec:
    """What the autograd function needs besides its tensors: fn, the arguments' kinds, the chunks, and what
    the first chunk learned about fn's outputs (which are None, which carry a gradient)."""

    def __init__(self, fn, flat, chunks):
        self.fn, self.flat, self.chunks = fn, flat, chunks
        self.absent: tuple[bool, ...] = ()
        self.differentiable: tuple[bool, ...] = ()
        self.single = True


class _ChunkedLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: _Spec, *tensors):
        parts = []
        for i, sl in enumerate(spec.chunks):
            with torch.enable_grad():  # to learn which outputs depend on the logits (first chunk)
                _, args = _chunk_args(spec.flat, sl, grad=i == 0)
                out = _as_tuple(spec.fn(*args))
            if i == 0:
                spec.single = not isinstance(out, _Multi)
                spec.absent = tuple(o is None for o in out)
                spec.differentiable = tuple(o is not None and o.requires_grad for o in out)
            parts.append([o.detach() for o in out if o is not None])
        outs = tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))
        present = [d for d, a in zip(spec.differentiable, spec.absent) if not a]
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, present) if not d])
        ctx.set_materialize_grads(False)
        ctx.spec, ctx.present = spec, present
        return outs

    @staticmethod
    def backward(ctx, *grads):
        spec = ctx.spec
        heads = [a for a in spec.flat if isinstance(a, LogitsHead)]
        grad_h = [torch.zeros_like(h.hidden_BSH) if h.requires_grad else None for h in heads]
        grad_w = [
            torch.zeros(h.weight_vH.shape, dtype=torch.float32, device=h.weight_vH.device) if h.requires_grad else None
            for h in heads
        ]
        wanted = [g is not None and d for g, d in zip(grads, ctx.present)]
        if any(wanted):
            for sl in spec.chunks:
                with torch.enable_grad():
                    leaves, args = _chunk_args(spec.flat, sl, grad=True)
                    outs = [o for o in _as_tuple(spec.fn(*args)) if o is not None]
                    pairs = [(o, g[sl]) for o, g, w in zip(outs, grads, wanted) if w]
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                for h, leaf, gh, gw in zip(heads, leaves, grad_h, grad_w):
                    if leaf is None or leaf.grad is None:
                        continue
                    g_cV = leaf.grad
                    gh[sl] = torch.matmul(g_cV, h.weight_vH.detach())
                    gw.add_(torch.matmul(g_cV.t(), h.hidden_BSH[sl].detach()))
                del leaves, args, outs, pairs
        result, grads_of_heads = [None], iter(zip(heads, grad_h, grad_w))
        for a in spec.flat:
            if isinstance(a, LogitsHead):
                h, gh, gw = next(grads_of_heads)
                result += [gh, None if gw is None else gw.to(h.weight_vH.dtype)]
            elif a is not None:
                result.append(None)
        # fn is often a closure over the record that caches this function's outputs (LossInputs), whose
        # grad_fn holds ctx: drop the spec so that cycle does not keep the hidden states until a gc pass.
        ctx.spec = None
        return tuple(result)
