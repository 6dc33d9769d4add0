"""How the embedded engine calls the model: prefill new rows into their cache slots, and one decode step of
the running rows (megaopd.engine.cache). No locks here: the runner holds the model.

Both build the attention mask themselves and hand it to the model as a 4D mask (or {layer type: mask} for
models that mix sliding and full layers), which transformers' models take as prepared (no mask construction
of theirs, no question asked of the cache); bool for SDPA, additive (0 where seen, the dtype's minimum
elsewhere, as transformers' own eager masks) for eager attention:
    prefill  causal over the left-padded batch, padding keys masked (a padding query sees itself only, so
             no softmax row is empty);
    decode   row a sees positions 0 .. pos_a of its slot; sliding-window layers also drop what is further
             back than the window.
Positions count real tokens only, so a row gets the RoPE phases of its unpadded sequence.

On CUDA, decode steps may be replayed from CUDA graphs (megaopd.engine.graphs); this module is the eager form.

Legend: U distinct sequences of a prefill, P padded length, A running rows, L attended length, V vocabulary.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from megaopd.engine.cache import PrefillCopy, SlotCache


def layer_windows(model) -> dict[str, int | None]:
    """{layer type: sliding window or None} of the model's attention layers (full attention only, for most).
    Without layer_types, a model slides in every layer when its own code does: its modeling module builds
    sliding-window masks (Mistral, Mixtral, Phi-3, Starcoder2, Qwen3-MoE: when config.sliding_window is set
    and use_sliding_window is not False). A stray sliding_window in another model's config.json (Llama) is
    ignored, as that model ignores it."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if not layer_types:
        module = sys.modules.get(type(model).__module__)
        slides = module is not None and "create_sliding_window_causal_mask" in vars(module)
        layer_types = [
            "sliding_attention" if window and slides and getattr(cfg, "use_sliding_window", True) else "full_attention"
        ]
    return {t: (int(window) if t == "sliding_attention" and window else None) for t in set(layer_types)}


@dataclass
class Forward:
    """The model and how to call it: its device, the id that pads prompts, and forward's cache keyword."""

    model: Any
    """An HF causal LM (transformers' AutoModelForCausalLM)."""
    device: torch.device
    pad_id: int
    cache_kw: str
    """transformers 5.2x renamed forward's `past_key_values` to `cache` (the old name warns on every call
    and goes in 5.40); older releases know only the old name."""
    windows: dict[str, int | None] = field(default_factory=dict)
    compile: bool = False
    """Decode steps through torch.compile (EmbeddedEngineConfig.compile_decode)."""

    def __post_init__(self):
        if not self.windows:
            self.windows = layer_windows(self.model)
        # dynamic=True: one compilation serves the batch sizes and attended lengths (the graphs' keys; a batch of
        # one row compiles again); the CUDA graphs then capture the compiled kernels (mode=None: inductor's own
        # cudagraphs stay off).
        self._step = torch.compile(self._eager_step, dynamic=True) if self.compile else self._eager_step
        # SDPA (and the engine's own, megaopd.engine.attention) takes bool masks; eager attention adds the mask
        # to the scores, so it needs 0 / the dtype's minimum (a bool True would add 1).
        self._additive = getattr(self.model.config, "_attn_implementation", "sdpa") == "eager"
        self._dtype = self.model.dtype

    def _masks(self, q_pos: torch.Tensor, k_pos: torch.Tensor, visible: torch.Tensor):
        """The 4D mask, or {layer type: mask} for models with several (only they read a dict: a 4D tensor
        is what every model takes as prepared)."""
        out = {}
        for kind, window in self.windows.items():
            m = visible
            if window is not None:
                m = m & (k_pos > q_pos - window)
            if self._additive:
                m = torch.zeros(m.shape, dtype=self._dtype, device=m.device).masked_fill(
                    ~m, torch.finfo(self._dtype).min
                )
            out[kind] = m
        return next(iter(out.values())) if len(out) == 1 else out

    def prefill(self, cache: SlotCache, seqs: list[list[int]], copies: list[PrefillCopy]) -> torch.Tensor:
        """Runs the distinct sequences (left-padded) and copies their keys into the slots `copies` name;
        returns the last position's logits [U, V] in float32."""
        U, P = len(seqs), max(len(s) for s in seqs)
        ids_UP = torch.full((U, P), self.pad_id, dtype=torch.long)
        real_UP = torch.zeros((U, P), dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids_UP[i, P - len(s) :] = torch.tensor(s, dtype=torch.long)
            real_UP[i, P - len(s) :] = True
        ids_UP, real_UP = ids_UP.to(self.device), real_UP.to(self.device)
        pos_UP = (real_UP.long().cumsum(-1) - 1).clamp(min=0)
        ar_P = torch.arange(P, device=self.device)
        causal_PP = ar_P[None, :] <= ar_P[:, None]
        visible = (causal_PP[None] & real_UP[:, None, :]) | torch.eye(P, dtype=torch.bool, device=self.device)[None]
        masks = self._masks(pos_UP[:, :, None], pos_UP[:, None, :], visible)
        masks = masks[:, None] if torch.is_tensor(masks) else {k: m[:, None] for k, m in masks.items()}
        out = self.model(
            input_ids=ids_UP,
            attention_mask=masks,
            position_ids=pos_UP,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: cache.for_prefill(copies)},
        )
        cache.for_prefill(None)
        return out.logits[:, -1, :].float()

    def step(
        self, cache: SlotCache, tokens_A: torch.Tensor, pos_A: torch.Tensor, rows_A: torch.Tensor, length: int
    ) -> torch.Tensor:
        """One token per running row (slots 0 .. A-1), written at pos_A; attention over the first `length`
        positions of each slot. Returns logits [A, V] (the model's dtype: the sampler upcasts)."""
        try:
            return self._step(cache, tokens_A, pos_A, rows_A, length)
        except torch._dynamo.exc.TorchDynamoException as e:  # a compilation that fails leaves eager decoding
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise  # the graph capture fails (megaopd.engine.graphs turns graphs off); the next call retries
            warnings.warn(
                f"torch.compile of the decode step failed ({type(e).__name__}: {str(e)[:200]}); "
                "the embedded engine decodes without it",
                stacklevel=2,
            )
            self._step = self._eager_step
            return self._step(cache, tokens_A, pos_A, rows_A, length)

    def _eager_step(
        self, cache: SlotCache, tokens_A: torch.Tensor, pos_A: torch.Tensor, rows_A: torch.Tensor, length: int
    ) -> torch.Tensor:
        k_pos = torch.arange(length, device=self.device)[None, None, None, :]
        q_pos = pos_A[:, None, None, None]
        masks = self._masks(q_pos, k_pos, k_pos <= q_pos)
        out = self.model(
            input_ids=tokens_A[:, None],
            attention_mask=masks,
            position_ids=pos_A[:, None],
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: cache.for_decode(rows_A, pos_A, length)},
        )
        return out.logits[:, -1, :]
