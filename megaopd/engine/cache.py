"""The embedded engine's static KV cache: one buffer per layer, a slot per running row.

    K, V of layer l: [slots, kv heads, capacity, head dim], allocated once (megaopd.engine.runner keeps it
    between runs; release_memory("kv_cache") drops it). Slot s holds one row's tokens at positions
    0 .. len-1, so every row has its own length and position: a finished row frees its slot for a waiting
    row without touching the others (continuous batching, megaopd.engine.decode).

The running rows occupy slots 0 .. A-1 (the decode loop keeps them packed by moving a row from the end into
a freed slot), so a decode step reads the views K[:A, :, :L] without copying. transformers' models call
`cache.update(key, value, layer_idx, ...)` in every attention layer (the Cache protocol); this class answers
it in one of two modes set before each forward:

    prefill  the new rows' keys and values (a left-padded batch of distinct prompts) are copied into their
             slots, left-aligned (a prompt shared by n samples is copied into n slots); attention uses
             the batch's own keys, so the call returns them unchanged;
    decode   each row's one new key and value are written at its own position, and the call returns the
             views of the running slots up to the longest row (positions past a row's length are masked).

transformers' StaticCache writes every row at the same position (one cache_position for the batch), which
is what continuous batching cannot use; its layout and in-place update are the same as here.

Legend: S slots, A running rows, H kv heads, C capacity (positions per slot), D head dim, L attended length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillCopy:
    """Where a prefilled sequence's keys go: batch row `u` (left-padded by `pad`) into slot `slot`."""

    u: int
    slot: int
    pad: int
    length: int


class SlotCache:
    """Static per-layer K/V buffers with a slot per row; see the module docstring."""

    def __init__(self, model_config, slots: int, capacity: int, device: torch.device, dtype: torch.dtype):
        cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        layers = int(cfg.num_hidden_layers)
        self.slots, self.capacity = slots, capacity
        shape = (slots, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self._copies: list[PrefillCopy] | None = None
        self._src_u = self._src_pos = self._dst_slot = self._dst_pos = None  # set by for_prefill
        self._rows_A: torch.Tensor | None = None
        self._pos_A: torch.Tensor | None = None
        self._length = 0

    @staticmethod
    def bytes_per_token(model_config, dtype: torch.dtype) -> int:
        """K and V bytes of one position of one slot, over all layers."""
        cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        return 2 * int(cfg.num_hidden_layers) * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def for_prefill(self, copies: list[PrefillCopy] | None) -> "SlotCache":
        """Where the next forward's keys go (None: done). Every layer then copies them with one gather and one
        scatter: positions 0 .. P-1 of each slot take its sequence's keys from its pad on, so a slot's positions
        past its length take copies of its last key (finite, masked until its own decode step writes there).
        A copy per sequence and layer would be 2 x N x layers kernels, issued one by one (3,584 at 64 rows x 28
        layers, more than the forward's own ~1,300), each issued by the host on a GPU."""
        self._copies = copies
        if copies:
            device, P = self.k[0].device, max(c.pad + c.length for c in copies)
            ar_P = torch.arange(P, device=device)
            self._src_u = torch.tensor([c.u for c in copies], device=device)[:, None]
            self._src_pos = (torch.tensor([c.pad for c in copies], device=device)[:, None] + ar_P).clamp(max=P - 1)
            self._dst_slot = torch.tensor([c.slot for c in copies], device=device)[:, None]
            self._dst_pos = ar_P[None, :]
        return self

    def for_decode(self, rows_A: torch.Tensor, pos_A: torch.Tensor, length: int) -> "SlotCache":
        """rows_A: arange(A) on the device (the running slots); pos_A: where each writes; length: L."""
        self._copies, self._rows_A, self._pos_A, self._length = None, rows_A, pos_A, length
        return self

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' Cache.update: key/value [A or U, H, q length, D]; returns what attention reads."""
        K, V = self.k[layer_idx], self.v[layer_idx]
        if self._copies is not None:
            # [N, P] indices around the slice: the result is [N, P, H, D] on both sides
            K[self._dst_slot, :, self._dst_pos] = key_states[self._src_u, :, self._src_pos]
            V[self._dst_slot, :, self._dst_pos] = value_states[self._src_u, :, self._src_pos]
            return key_states, value_states
        A = key_states.shape[0]
        K[self._rows_A, :, self._pos_A] = key_states[:, :, 0]
        V[self._rows_A, :, self._pos_A] = value_states[:, :, 0]
        return K[:A, :, : self._length], V[:A, :, : self._length]

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Copies slots src -> dst (positions < length), to keep the running rows packed."""
        if not src:
            return
        s = torch.tensor(src, device=self.k[0].device)
        d = torch.tensor(dst, device=self.k[0].device)
        for t in self.k + self.v:
            t[d, :, :length] = t[s, :, :length]
