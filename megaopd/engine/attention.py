"""The embedded engine's attention: transformers' SDPA, with a decode step's queries packed onto the KV heads.

In a decode step each row has one query. A grouped-query model (Qwen2.5-1.5B: 12 query heads on 2 key/value
heads, G = 6) shares each key/value head among G query heads. transformers' SDPA path (5.17, the GPU image's)
then copies every key and value G times (repeat_kv) whenever a mask is passed, and the engine always passes one
(rows of different lengths share a step). At 64 rows x 256 positions of the 1.5B model that is ~2.8 GB written
and read again per step, nearly the weights' 3.1 GB.

Packing: the G query heads of one KV head are G query positions of that head,

    out[a, j*G + g] = softmax(q[a, j*G + g] . K[a, j]^T * scale + mask[a]) V[a, j]
                    = SDPA(q.view(A, Hkv, G, D), K, V, mask[a, :, :1] broadcast over the G "positions")[a, j, g]

so keys and values are read once from the cache, in place. The mask of a decode step is the same for every
head and query of a row ([A, 1, 1, L]), so it broadcasts unchanged. transformers 5.24 packs the same way
itself (pack_gqa); doing it here keeps the engine's speed independent of the installed version.

Everything else (prefill, models without grouped KV heads, masks that differ by head) goes to transformers'
own sdpa_attention_forward unchanged.
"""

from __future__ import annotations

import torch

ATTENTION = "megaopd_sdpa"
"""The name the engine's models are loaded with (EmbeddedEngineConfig.attn_implementation="sdpa"). It must contain
"sdpa": transformers then checks at load that the model can run SDPA at all (it refuses models that need
attention sinks or logit soft-capping, which this function would silently drop)."""


def engine_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' attention-function protocol: query [A, H, Q, D], key/value [A, Hkv, L, D]; returns
    ([A, Q, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    A, H, Q, D = query.shape
    kv_heads = key.shape[1]
    groups = H // kv_heads
    shared_mask = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)
    if Q != 1 or groups == 1 or not shared_mask or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(A, kv_heads, groups, D), key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(A, H, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def register() -> str:
    """Makes ATTENTION a transformers attention implementation (idempotent); returns its name. Its mask function
    is SDPA's: a call without a prepared mask (prompt scoring) gets the model's own causal and sliding-window
    masks, where an unknown name would get none (and lose its sliding windows)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, engine_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    return ATTENTION
