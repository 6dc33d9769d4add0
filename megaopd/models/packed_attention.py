"""Core attention that takes packed sequences (THD: one row of several sequences, cu_seqlens).

megatron-core's local `DotProductAttention` refuses `packed_seq_params`; Transformer Engine's takes
them but needs TE and a GPU. `PackedDotProductAttention` is the local spec's core attention in
megaopd (chosen by `compat.decoder_block_spec`, not by branches in model code):

- no `packed_seq_params` (the padded [s, b] path): on CPU, megatron's own DotProductAttention, unchanged
  (the golden CPU runs pin it). On CUDA, causal self-attention without a mask tensor goes through torch's
  `scaled_dot_product_attention(is_causal=True)` (the flash kernel in bf16) instead: megatron's local
  attention materializes [b, heads, s, s] scores and probabilities for the backward, which at 8k tokens
  and 24 layers of a 0.5B model is over 70 GiB (measured: the padded step ran out of memory on an H100;
  benchmarks/README.md). Anything else (a mask tensor, sliding windows, attention dropout) stays megatron's;
- `packed_seq_params.qkv_format == "thd"`: q/k/v arrive as [t, heads, head_dim] (megatron's
  Attention squeezes the dummy batch and has already applied RoPE per sequence from cu_seqlens, so
  positions restart at 0 in every sequence). Every sequence attends causally to itself only: the
  block-diagonal causal mask of cu_seqlens. On CUDA in fp16/bf16 that is torch's varlen flash kernel
  (`torch.nn.attention.varlen.varlen_attn`, window (-1, 0) = causal); elsewhere (CPU, float32) it is
  `scaled_dot_product_attention(is_causal=True)` over the sequences batched by length (`causal_by_length`):
  exactly the diagonal blocks of the block-diagonal causal mask, without the [t, t] scores off them, so
  attention costs about sum(len^2) like the packed kernels, not t^2.

Attention dropout is not applied on the packed path (megaopd's configs set it to 0; a nonzero value is
refused).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


@functools.cache
def _varlen_attn():
    """torch's varlen flash attention and the names of its keyword arguments, or None (torch < 2.9).

    Its signature moved between torch releases: 2.9/2.10 take `is_causal` (and no scale before 2.10),
    later ones `window_size=(-1, 0)` for causal, `scale` and `enable_gqa`. Read once (every layer of every
    packed forward asks)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


class PackedDotProductAttention(DotProductAttention):
    """megatron's local core attention, plus packed sequences (see the module docstring)."""

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is None:
            if self._padded_sdpa(query, attention_mask, attn_mask_type, attention_bias):
                return self._causal_sdpa(query, key, value)
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"PackedDotProductAttention takes qkv_format='thd', got {packed_seq_params.qkv_format!r}")
        if attention_bias is not None:
            raise ValueError("PackedDotProductAttention takes no attention_bias")
        if self.training and self.attention_dropout.p > 0:
            raise ValueError("attention_dropout > 0 is not supported with packed sequences; set it to 0")
        cu = packed_seq_params.cu_seqlens_q
        kv = packed_seq_params.cu_seqlens_kv
        # (the runner passes one tensor for both: comparing values would sync the GPU in every layer)
        if kv is not None and kv is not cu and not torch.equal(kv, cu):
            raise ValueError("packed self-attention needs cu_seqlens_kv == cu_seqlens_q")
        t = query.shape[0]
        scale = self._scale()
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        varlen = _varlen_attn()
        head_dim = query.shape[-1]
        default_scale = abs(scale - head_dim**-0.5) < 1e-12 * head_dim**-0.5
        if (
            query.is_cuda
            and query.dtype in (torch.float16, torch.bfloat16)
            and varlen is not None
            and ("scale" in varlen[1] or default_scale)
        ):
            fn, params = varlen
            cu32 = cu.to(device=query.device, dtype=torch.int32)
            m = int(packed_seq_params.max_seqlen_q)
            kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
            if "scale" in params:
                kwargs["scale"] = scale
            if gqa and "enable_gqa" in params:
                kwargs["enable_gqa"] = True
            elif gqa:  # older varlen_attn has no enable_gqa: repeat the KV heads (query head i uses i // r)
                r = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
                key, value = key.repeat_interleave(r, dim=1), value.repeat_interleave(r, dim=1)
            out = fn(query, key, value, cu32, cu32, m, m, **kwargs)
            return out.reshape(t, self.hidden_size_per_partition)
        return causal_by_length(query, key, value, cu.tolist(), scale, gqa).reshape(t, self.hidden_size_per_partition)

    def _scale(self) -> float:
        # megatron divides softmax_scale by the layer number under query-key layer scaling and multiplies
        # the scores back inside its softmax: the effective scale is the product.
        return self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)

    def _padded_sdpa(self, query, attention_mask, attn_mask_type, attention_bias) -> bool:
        """The padded path takes torch's fused causal attention: CUDA, causal, no mask tensor, no bias,
        no dropout while training, no sliding window, no attention sinks."""
        # (megatron's local attention ignores the attn_mask_type argument and masks by its own type)
        return (
            query.is_cuda
            and attention_mask is None
            and attention_bias is None
            and self.attn_mask_type == AttnMaskType.causal
            and query.shape[0] > 0
            and not (self.training and self.attention_dropout.p > 0)
            and getattr(self.config, "window_size", None) is None
            and getattr(self, "softmax_offset", None) is None
        )

    def _causal_sdpa(self, query, key, value):
        """[s, b, heads, d] q/k/v -> [s, b, heads * d]; KV heads repeated for grouped-query attention so
        the flash kernel (which takes equal head counts) is the one that runs."""
        r = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if r > 1:
            key, value = key.repeat_interleave(r, dim=2), value.repeat_interleave(r, dim=2)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self._scale())
        s, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)


# A sequence joins a batch of longer ones if the batch's longest is at most this much longer (padding costs at
# most ratio^2 of its attention, and nothing of the rest of the layer); a batch's score tensor stays under
# MAX_BATCH_SCORES elements (what the math kernel may materialize).
LENGTH_RATIO = 1.25
MAX_BATCH_SCORES = 1 << 24


def length_batches(
    lengths: list[int], ratio: float = LENGTH_RATIO, max_scores: int = MAX_BATCH_SCORES, heads: int = 1
) -> list[list[int]]:
    """Indices of the non-empty sequences, longest first, cut into batches whose longest is at most `ratio`
    times their shortest and whose [n, heads, longest, longest] scores hold at most `max_scores` elements
    (a sequence longer than that is a batch of its own)."""
    batches: list[list[int]] = []
    for i in sorted((i for i, n in enumerate(lengths) if n), key=lambda i: -lengths[i]):
        if batches:
            top = lengths[batches[-1][0]]
            if lengths[i] * ratio >= top and (len(batches[-1]) + 1) * heads * top * top <= max_scores:
                batches[-1].append(i)
                continue
        batches.append([i])
    return batches


def causal_by_length(
    query, key, value, bounds: list[int], scale: float, gqa: bool, max_scores: int = MAX_BATCH_SCORES
) -> torch.Tensor:
    """Causal self-attention within each sequence of a packed row: q [t, hq, d], k/v [t, hk, d], sequence i
    at [bounds[i], bounds[i+1]) with bounds[0] = 0 and bounds[-1] = t -> [t, hq, d].

    One `scaled_dot_product_attention(is_causal=True)` call per batch of similar lengths (length_batches,
    max_scores as there), each sequence right-padded to its batch's longest with
    zeros: a real query at position j sees keys 0..j, all of its own sequence, so padding is never attended,
    gets no gradient, and cannot carry another sequence's inf or NaN in (0 x NaN would); padded queries'
    outputs are dropped. The gather and scatter indices are built on the host from `bounds` and copied once
    per batch: no device sync. On CPU this replaced one call per sequence, whose per-call overhead set the
    packed step's time (benchmarks/README.md, "Packed attention on CPU")."""
    t, device = query.shape[0], query.device
    if bounds[0] != 0 or bounds[-1] != t:
        raise ValueError(f"cu_seqlens {bounds[:3]}...{bounds[-1:]} must run from 0 to the packed row's {t} tokens")
    if t == 0:
        return query.clone()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    outs, positions = [], []
    for batch in length_batches(lengths, max_scores=max_scores, heads=query.shape[1]):
        n, longest = len(batch), lengths[batch[0]]
        steps = torch.arange(longest)
        index = (torch.tensor([bounds[i] for i in batch])[:, None] + steps).clamp_(max=t - 1)  # [n, longest]
        valid = steps < torch.tensor([lengths[i] for i in batch])[:, None]
        real = valid.reshape(-1).nonzero().squeeze(1)
        positions.append(index.reshape(-1)[real])
        index, valid, real = (x.to(device, non_blocking=True) for x in (index.reshape(-1), valid, real))
        q, k, v = (
            torch.where(
                valid[:, :, None, None], x.index_select(0, index).view(n, longest, *x.shape[1:]), 0.0
            ).transpose(1, 2)
            for x in (query, key, value)
        )  # [n, heads, longest, d], padding zero
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(-1, *query.shape[1:]).index_select(0, real))
    order = torch.empty(t, dtype=torch.long)
    order[torch.cat(positions)] = torch.arange(t)  # row of the batched output for each token
    return torch.cat(outs).index_select(0, order.to(device, non_blocking=True))
