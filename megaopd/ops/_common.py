"""Shared pieces of the vocab-parallel ops: vocabulary ranges, TP collectives, token chunking, and the
per-chunk math every op builds on.

Legend for tensor names in megaopd/ops:
  T   tokens: all leading dimensions of the input flattened ([s, b] or [b, s] -> T)
  V   the LOCAL vocabulary shard (full vocabulary / TP); rank r owns global ids [r*V, (r+1)*V)
  K   support / top-k size (k in top-k), C candidates merged from all ranks (R * min(k, V))
  R   ranks of the TP group
  raw the model's logits as given (any float dtype); z = raw / temperature, always float32 here.

How the ops stay exact without gathering the vocabulary. Each rank reduces its shard to a few numbers
per token, all relative to the shard's own max m_r (in raw units):
    s_r = sum_{v in shard r} exp((raw_v - m_r) / temperature)             (and op-specific sums)
then one all-reduce MAX gives the global max M = max_r m_r and one all-reduce SUM combines the
rescaled sums: S = sum_r exp((m_r - M) / temperature) * s_r, so lse = M / temperature + log S.
Keeping M and log S apart (instead of one float32 lse) keeps log p = (raw - M) / temperature - log S
accurate to float32 rounding of O(1) numbers even when the logits are ~1e4 (their ulp is ~1e-3).
Backward passes need no communication: the softmax of the local shard is recomputed from the saved
logits and the saved per-token (M, log S), chunk by chunk over tokens.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

# Default chunk: tokens such that one float32 [chunk, V] buffer is about this many bytes. The ops keep
# a few such buffers alive at a time, so this bounds their extra peak memory.
DEFAULT_CHUNK_BYTES = 128 * 2**20


def vocab_range(vocab_shard_size: int, rank: int) -> tuple[int, int]:
    """Global ids [start, end) owned by TP rank `rank` (megatron's contiguous vocab sharding)."""
    start = rank * vocab_shard_size
    return start, start + vocab_shard_size


def group_rank_and_size(group) -> tuple[int, int]:
    """(rank, size) in the TP group; `None` is one process holding the whole vocabulary."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce_(tensor: torch.Tensor, op, group) -> torch.Tensor:
    """In-place all-reduce over the TP group; a no-op for one process."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """The tensors of every TP rank, in rank order (so in global-vocabulary order)."""
    if group is None or dist.get_world_size(group) == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def check_temperature(temperature: float) -> float:
    temperature = float(temperature)
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    return temperature


def token_chunks(num_tokens: int, vocab_shard_size: int, chunk_size: int | None) -> list[slice]:
    """Slices of at most `chunk_size` tokens (None: sized so a float32 chunk is DEFAULT_CHUNK_BYTES)."""
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_BYTES // (4 * max(1, vocab_shard_size)))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return [slice(i, min(i + chunk_size, num_tokens)) for i in range(0, num_tokens, chunk_size)]


def flatten_tokens(x: torch.Tensor, name: str) -> torch.Tensor:
    """[..., V] -> [T, V]; a view for contiguous inputs (pass contiguous logits to avoid a copy)."""
    if x.dim() < 1:
        raise ValueError(f"{name} must have a vocabulary dimension, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {x.dtype}")
    return x.reshape(-1, x.shape[-1])


def check_same_tokens(leading: torch.Size, other: torch.Tensor, name: str, trailing: int = 0) -> None:
    got = other.shape[: other.dim() - trailing] if trailing else other.shape
    if tuple(got) != tuple(leading):
        raise ValueError(
            f"{name} has leading shape {tuple(got)}, expected {tuple(leading)} "
            f"(the logits' shape without the vocabulary dimension)"
        )


# ---- per-chunk math (no communication) ---------------------------------------------------------------


def shifted(raw_cV: torch.Tensor, max_c: torch.Tensor, temperature: float) -> torch.Tensor:
    """(raw - max) / temperature as a NEW float32 [c, V] tensor (safe to modify in place).

    Subtracting before dividing keeps the entries near the max exact in float32 (Sterbenz), which is
    where the probability mass is.
    """
    x_cV = raw_cV.float() - max_c.unsqueeze(-1)  # never aliases the input, even for float32 input
    if temperature != 1.0:
        x_cV.div_(temperature)
    return x_cV


def log_softmax_chunk(raw_cV, max_c, log_sumexp_c, temperature) -> torch.Tensor:
    """Full-vocabulary log-probs of the local shard's entries, new float32 [c, V]."""
    return shifted(raw_cV, max_c, temperature).sub_(log_sumexp_c.unsqueeze(-1))


def local_max_sumexp(logits_TV: torch.Tensor, temperature: float, chunks: list[slice]):
    """One pass over the shard: its per-token max (raw units) and sum exp((raw - max)/temperature)."""
    T = logits_TV.shape[0]
    max_T = torch.empty(T, dtype=torch.float32, device=logits_TV.device)
    sumexp_T = torch.empty_like(max_T)
    for sl in chunks:
        raw_cV = logits_TV[sl]
        max_c = raw_cV.amax(dim=-1).float()
        max_T[sl] = max_c
        sumexp_T[sl] = shifted(raw_cV, max_c, temperature).exp_().sum(dim=-1)
    return max_T, sumexp_T


# ---- cross-rank combination (the collectives) --------------------------------------------------------


def global_max(local_max, temperature, group):
    """All-reduce MAX of per-token shard maxima (any shape [..., T]).

    Returns (max, shift, scale): the global max, shift = (local max - global max) / temperature <= 0 and
    scale = exp(shift), the factor that moves a sum taken relative to the local max onto the global one.
    """
    max_ = all_reduce_(local_max.clone(), dist.ReduceOp.MAX, group)
    shift = (local_max - max_) / temperature
    return max_, shift, shift.exp()


def global_max_log_sumexp(local_max_T, local_sumexp_T, temperature, group, *extra_sums_T):
    """Global (max_T, log_sumexp_T) from per-shard stats; `extra_sums_T` (already additive over ranks,
    e.g. a gathered logit that only its owner contributes) ride in the same SUM all-reduce."""
    max_T, _, scale_T = global_max(local_max_T, temperature, group)
    sums_nT = all_reduce_(torch.stack([local_sumexp_T * scale_T, *extra_sums_T]), dist.ReduceOp.SUM, group)
    return max_T, sums_nT[0].log(), sums_nT[1:]


def owned_local_ids(ids: torch.Tensor, vocab_shard_size: int, group):
    """For global ids: (owned mask, local index clamped into the shard) on this rank."""
    rank, _ = group_rank_and_size(group)
    start, end = vocab_range(vocab_shard_size, rank)
    owned = (ids >= start) & (ids < end)
    return owned, torch.where(owned, ids - start, torch.zeros_like(ids))


# ---- implementation choice ---------------------------------------------------------------------------

IMPLS = ("auto", "triton", "torch")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(impl: str, logits: torch.Tensor) -> str:
    """ "triton" or "torch" for an op on `logits`. auto: the Triton kernels (_triton.py) on CUDA when triton
    is installed, the torch path (the reference) otherwise. "triton" on CPU tensors runs only under Triton's
    interpreter (TRITON_INTERPRET=1, read by triton when the kernels are first imported: the tests)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if logits.is_cuda and triton_available() else "torch"
    if impl == "triton":
        if not triton_available():
            raise ValueError(
                "impl='triton' needs the triton package (pip install triton==3.7.1; "
                "scripts/install.sh installs it), or pass impl='torch'"
            )
        if not logits.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"impl='triton' on {logits.device.type} tensors needs Triton's interpreter: set "
                f"TRITON_INTERPRET=1 before megaopd.ops' kernels are first used, or pass impl='torch'"
            )
    return impl
