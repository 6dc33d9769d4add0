"""SGLang's memory tags, and what releasing the embedded engine's weights does.

release_memory(tags) / resume_memory(tags) take tags among MEMORY_TAGS (None = all, as SGLang). An engine
remembers what it released and refuses to resume a tag it never released (MemoryStateError), as SGLang
0.5.23 does in its own way: it kills the server. The HTTP client (megaopd.rollout.client) keeps the same
rule for remote servers, so a trainer never sends that request.

The embedded engine's weights, by EmbeddedEngineConfig.release_weights (colocated engines):
  keep     weights stay where they are (the CPU default: moving CPU tensors to the CPU frees nothing);
  offload  weights move to the CPU and back on resume (the GPU default);
  discard  weights are freed (discard); resume allocates zeros (restore), and the runner refuses to
           generate until every weight has been loaded again (SGLang without a CPU backup behaves alike).
The static KV cache (megaopd.engine.cache) is allocated by the first run and kept; releasing "kv_cache"
(or "cuda_graph") waits for the running batch, drops the cache and the decode steps captured over it
(megaopd.engine.graphs, CUDA only) and empties the allocator cache; the next run after resume allocates
and captures them again. While released, generation raises EngineReleasedError.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's memory tags (release/resume_memory_occupation); None in a request means all of them."""


class MemoryStateError(ValueError):
    """resume_memory was asked for a tag that is not released (SGLang 0.5.23 dies on this: KeyError in
    its scheduler, then SIGQUIT to its parent), or release/resume got an unknown tag."""


class EngineReleasedError(RuntimeError):
    """generate was called while memory is released or weights are discarded and not yet reloaded."""


def memory_tags(tags: Sequence[str] | None, who: str) -> list[str]:
    """The tags a release/resume request names (None = all, as SGLang); MemoryStateError for unknown ones."""
    wanted = list(MEMORY_TAGS) if tags is None else list(tags)
    bad = [t for t in wanted if t not in MEMORY_TAGS]
    if bad:
        raise MemoryStateError(f"{who}: unknown memory tags {bad}; use {list(MEMORY_TAGS)}")
    return wanted


def check_resume(tags: Sequence[str] | None, released: Iterable[str], who: str) -> list[str]:
    """The tags a resume request names (None = all, as SGLang), or MemoryStateError naming the unreleased ones."""
    wanted = memory_tags(tags, who)
    released = set(released)
    missing = [t for t in wanted if t not in released]
    if missing:
        raise MemoryStateError(
            f"{who}: cannot resume {missing}: not released (released: {sorted(released)}). Resume only what "
            "release_memory freed; SGLang kills the server on this request"
        )
    return wanted


def discard(params: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Frees the storage of every tensor of a state_dict(keep_vars=True); returns name -> (shape, dtype)
    for restore. Tied names alias one tensor, which is freed (and later restored) once."""
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
    seen: set[int] = set()
    for name, t in params.items():
        if id(t) not in seen:
            seen.add(id(t))
            shapes[name] = (t.shape, t.dtype)
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return shapes


def restore(
    params: dict[str, torch.Tensor], shapes: dict[str, tuple[torch.Size, torch.dtype]], device: torch.device
) -> None:
    """Re-allocates what discard freed, as zeros: the weights stay unusable until they are loaded again."""
    for name, (shape, dtype) in shapes.items():
        params[name].data = torch.zeros(shape, dtype=dtype, device=device)
