"""Decode steps replayed from CUDA graphs (CUDA only; the CPU runs megaopd.engine.forward eagerly).

A decode step of A running rows launches hundreds of small kernels; on a GPU their launch, not their work,
sets the pace (the issue's profile: 567 ms of CPU to 119 ms of GPU for 16 steps). So, as SGLang does for
its `cuda_graph_bs`, the step (model forward over the slot cache, megaopd.engine.forward.Forward.step) is
captured with torch.cuda.CUDAGraph for a set of batch sizes and replayed: a step of A rows replays the
graph of the smallest captured batch size >= A, the rows past A being padding (slots A.. are free: the
running rows are packed; a padding row writes position 0 of its free slot, which a later prefill
overwrites). Attention reads a fixed number of positions per graph, so graphs are also keyed by a length
bucket (256, 384, 512, 768, ...: powers of two from 256 and the midpoints 1.5 x 2^k, up to the cache's
capacity): a short batch does not pay for the longest possible row, and past 256 positions at most a third
of the positions a step reads lie beyond its longest row (at OPD lengths the keys and values outweigh the
weights: at 64 rows of 8k positions the 1.5B model reads 15 GB of cache a step to its 3.1 GB of weights).
Graphs are captured when first needed and share one memory pool; they read their inputs from buffers of
their own (the step's tokens and positions are copied in before a replay) and write their logits into one
[slots, V] buffer (so that a graph's output does not hold memory of its own: ~20 MB per graph of 64 rows of
the 1.5B model, times every batch size and bucket).

A graph is valid while the tensors it read at capture keep their storage: the runner drops these graphs
with the KV cache, and when weights move (release_memory / resume_memory of "weights", "cuda_graph").
A capture that fails (a model whose forward syncs with the host, say) turns graphs off for this engine,
with a warning, and decoding goes on eagerly.
"""

from __future__ import annotations

import warnings

import torch

from megaopd.engine.cache import SlotCache
from megaopd.engine.forward import Forward


def default_batch_sizes(slots: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to slots (and slots itself), as SGLang's default cuda_graph_bs."""
    sizes = [b for b in (1, 2, 4) if b < slots] + list(range(8, slots, 8)) + [slots]
    return sorted(set(sizes))


def length_buckets(capacity: int) -> list[int]:
    """256, 384, 512, 768, 1024, 1536, ... below capacity, then capacity (multiples of CACHE_ROUND)."""
    out, n = [], 256
    while n < capacity:
        out.append(n)
        if n * 3 // 2 < capacity:
            out.append(n * 3 // 2)
        n *= 2
    return out + [capacity]


class DecodeGraphs:
    """Captured decode steps over one SlotCache; step() returns None when no graph applies (then eager)."""

    def __init__(self, fwd: Forward, cache: SlotCache, batch_sizes: list[int] | None):
        self.fwd, self.cache = fwd, cache
        sizes = (
            default_batch_sizes(cache.slots)
            if batch_sizes is None
            else sorted({min(int(b), cache.slots) for b in batch_sizes})
        )
        self.batch_sizes = sizes
        self.buckets = length_buckets(cache.capacity)
        dev = fwd.device
        self.tokens = torch.zeros(cache.slots, dtype=torch.long, device=dev)
        self.pos = torch.zeros(cache.slots, dtype=torch.long, device=dev)
        self.rows = torch.arange(cache.slots, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [slots, V], every graph's output
        self.pool = None
        self.off: str | None = None

    def step(self, st, A: int, length: int) -> torch.Tensor | None:
        if self.off is not None:
            return None
        bs = next((b for b in self.batch_sizes if b >= A), None)
        L = next((b for b in self.buckets if b >= length), None)
        if bs is None or L is None:
            return None
        self.tokens[:A].copy_(st.token_S[:A])
        self.pos[:A].copy_(st.pos_S[:A])
        if bs > A:
            self.tokens[A:bs].zero_()
            self.pos[A:bs].zero_()
        graph = self.graphs.get((bs, L))
        if graph is None:
            try:
                graph = self.graphs[bs, L] = self._capture(bs, L)
            except Exception as e:  # noqa: BLE001 - eager decoding still works
                self.off = f"{type(e).__name__}: {e}"
                warnings.warn(
                    f"CUDA graph capture failed ({self.off}); the embedded engine decodes eagerly", stacklevel=2
                )
                return None
        graph.replay()
        return self.logits[:A]

    def _run(self, bs: int, L: int) -> torch.Tensor:
        return self.fwd.step(self.cache, self.tokens[:bs], self.pos[:bs], self.rows[:bs], L)

    def _capture(self, bs: int, L: int):
        dev = self.tokens.device
        caller = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph (allocator, lazy kernels); rewrites what the step writes
                out = self._run(bs, L)
        caller.wait_stream(side)
        if self.logits is None:
            self.logits = torch.empty((self.cache.slots, out.shape[-1]), dtype=out.dtype, device=dev)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA calls of the server's other threads (weight loads, NCCL) neither break the capture
            # nor fail because of it.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.logits[:bs].copy_(self._run(bs, L))
        except Exception:
            torch.cuda.set_stream(caller)  # a failed capture_end can leave this thread on the capture stream
            raise
        self.pool = graph.pool()
        return graph
