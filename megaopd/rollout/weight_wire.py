"""The bucket wire format of SGLang's /update_weights_from_distributed, and dtype names: what the
trainer's sender (megaopd.sync) and the engine's receiver (`megaopd serve`) both speak.

Wire format of one update:
  load_format None:                one broadcast from rank 0 per tensor, in `names` order;
  load_format "flattened_bucket":  one broadcast of a uint8 tensor: the tensors' bytes concatenated in
                                   `names` order (each flattened, native dtype), as SGLang's
                                   FlattenedTensorBucket lays them out.
Buckets bound the bytes in flight: the trainer's tensors are grouped, in order, into lists of at most
`bucket_bytes` (one HTTP request each).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16; ValueError naming the accepted strings."""
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, concatenated in order, as one uint8 tensor on the first tensor's device."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def bucket_nbytes(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> int:
    total = 0
    for dtype, shape in zip(dtypes, shapes):
        numel = 1
        for s in shape:
            numel *= int(s)
        total += numel * torch.empty((), dtype=dtype).element_size()
    return total


def unflatten_bucket(
    flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> list[tuple[str, torch.Tensor]]:
    """Views into `flat` (uint8) for each (name, dtype, shape), in order; inverse of flatten_bucket."""
    out, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        n = bucket_nbytes([dtype], [shape])
        out.append((name, flat[offset : offset + n].view(dtype).reshape(tuple(int(s) for s in shape))))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes but the metadata describes {offset}")
    return out


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Groups tensors, in order, into lists of at most `bucket_bytes` (a larger tensor gets its own bucket)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
