"""How to build the embedded engine: EmbeddedEngineConfig, and the EOS ids an HF directory declares."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Literal

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


CUDA_SYNC_EVERY = 8
"""sync_every=0 on CUDA: the host reads the finished flags every 8 decode steps (every step on CPU)."""
CACHE_ROUND = 128
"""The KV cache's positions per slot are a multiple of this (the decode graphs' length buckets)."""


def cache_positions(positions: int, sync_every: int) -> int:
    """Positions per slot of a cache for rows of up to `positions` tokens: decode runs up to sync_every steps
    past a row's end before the host sees it finish, and the count rounds up to CACHE_ROUND."""
    return -(-(positions + sync_every) // CACHE_ROUND) * CACHE_ROUND


@dataclass
class EmbeddedEngineConfig:
    """How to build and run the embedded engine."""

    hf_dir: str
    """HF model directory (config.json + safetensors), e.g. the student's initial checkpoint."""
    device: str = "auto"
    """"auto" (cuda when present, else cpu), "cpu", or a torch device string such as "cuda:1"."""
    dtype: str = "float32"
    """Compute dtype of the model: float32 | bfloat16 | float16 | float64. Use float32 on CPU."""
    max_batch_size: int = 64
    """Slots of the KV cache = rows decoded together; more rows wait and take the slots rows free."""
    sync_every: int = 0
    """Decode steps between two reads of the finished flags by the host; 0 = 1 on CPU, 8 on CUDA."""
    admit_min: int = 0
    """While rows run, waiting rows enter free slots once at least this many are free (or all of them fit):
    each admission is a prefill, an eager forward that on a GPU costs several decode steps. 0 = 1 on CPU,
    max(1, max_batch_size // 8) on CUDA; at most max_batch_size (`python benchmarks/rollout.py --only schedule`
    counts prefills and decode steps of the GPU check's mixed case for several values)."""
    cuda_graph_bs: list[int] | None = None
    """Batch sizes whose decode step is captured as a CUDA graph (SGLang's cuda_graph_bs); None = 1, 2, 4,
    8, then multiples of 8 up to max_batch_size; [] = eager decode. Ignored on CPU."""
    compile_decode: bool = False
    """torch.compile the decode step (dynamic shapes; on CUDA the graphs capture its kernels). An HF model's
    decode step is dozens of small kernels a layer (norms, rotary, residuals) that inductor fuses. The first
    run pays the compilation, and a batch of one row a second one: ~40 s each for a 4-layer model on a
    2-core CPU, where it made 1.1x the tokens/s (benchmarks/README.md, Rollout); unmeasured on a GPU."""
    mem_fraction_static: float = 0.85
    """On CUDA, the KV cache is sized so that everything allocated stays under this fraction of the GPU
    (SGLang's --mem-fraction-static): the slots get as many positions as fit, up to the model's context
    (unless context_length says how many are needed)."""
    context_length: int = 0
    """Positions a row can reach (prompt + everything generated after it). 0: as many as fit in
    mem_fraction_static, as a server sizes its pool for requests it cannot foresee. The trainer sets the
    longest row its rollouts make, so an engine beside the trainer's models holds only that much cache
    (0.85 of the GPU would take the memory the trainer needs); a longer row reallocates the cache."""
    release_weights: Literal["auto", "keep", "offload", "discard"] = "auto"
    """What release_memory does to the weights (megaopd.engine.memory); auto = offload on GPU, keep on CPU."""
    attn_implementation: str = "sdpa"
    """transformers attention backend: "sdpa" (transformers' SDPA, a decode step's queries packed onto the
    key/value heads: megaopd.engine.attention) or "eager" (transformers' own, given additive masks)."""
    load_tokenizer: bool = True
    """Load the HF dir's tokenizer when it has one (only used to fill the "text" field of responses)."""
    eos_token_ids: list[int] | None = None
    """Ids that end a response; None reads config.json and generation_config.json (their union)."""

    def __post_init__(self):
        if not os.path.isfile(os.path.join(self.hf_dir, "config.json")):
            raise ValueError(f"hf_dir={self.hf_dir!r} has no config.json; point it at an HF model directory")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {sorted(DTYPES)}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size} must be at least 1")
        if self.context_length < 0:
            raise ValueError(f"context_length={self.context_length} must be >= 0 (0 = what fits)")
        if not 0 <= self.admit_min <= self.max_batch_size:
            raise ValueError(
                f"admit_min={self.admit_min} must be in [0, max_batch_size={self.max_batch_size}] (0 = automatic)"
            )
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError(
                f"attn_implementation={self.attn_implementation!r}: choose sdpa or eager (the engine "
                "hands the model prepared 4D masks, which other backends cannot take)"
            )
        if self.sync_every < 0:
            raise ValueError(f"sync_every={self.sync_every} must be >= 0 (0 = automatic)")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1]")
        if self.cuda_graph_bs is not None and any(int(b) < 1 for b in self.cuda_graph_bs):
            raise ValueError(f"cuda_graph_bs={self.cuda_graph_bs}: batch sizes must be >= 1")
        if self.release_weights not in ("auto", "keep", "offload", "discard"):
            raise ValueError(f"release_weights={self.release_weights!r}; choose auto, keep, offload or discard")


def read_eos_ids(hf_dir: str) -> list[int]:
    """EOS ids of an HF dir: config.json's eos_token_id plus generation_config.json's (int or list)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                value = json.load(f).get("eos_token_id")
            for v in value if isinstance(value, list) else [value]:
                if v is not None and int(v) not in ids:
                    ids.append(int(v))
    return ids
