"""Reading a torch_dist (megatron dist_checkpointing) checkpoint without running code from it.

    state = load_safely(sharded_state_dict, ckpt_dir / "model")   # dist_checkpointing.load, restricted
    check_pickles(ckpt_dir / "model")                             # the same checks, no model, no ranks

A torch_dist folder holds three kinds of pickle, and upstream unpickles each without restriction somewhere:
- `.metadata`: torch DCP's FileSystemReader.read_metadata calls pickle.load. Read here by a restricted
  unpickler that admits only the classes DCP metadata is made of (METADATA_GLOBALS: torch.distributed.
  checkpoint's metadata and plan records, torch.Size, dtypes, layouts, a path).
- `common.pt`: megatron's TorchCommonLoadStrategy calls torch.load without weights_only, which torch's
  TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns into a plain unpickle. Read here with weights_only=True and
  megatron's own safe globals (megatron.core.safe_globals: what megatron's common state is made of).
- the byte items inside the shards (megatron's ShardedObjects, e.g. `_extra_state`): torch DCP's
  DefaultLoadPlanner.load_bytes calls torch.load(weights_only=False). Each is first read here with
  weights_only=True and the same globals; only what passes reaches the planner.
A global outside these is refused with one line naming it and the file (UnsafeCheckpointError).

How the restricted reader gets in: dist_checkpointing.load takes our strategies (SafeTorchDistLoadStrategy,
SafeCommonLoadStrategy); megatron's torch_dist strategy builds its FileSystemReader inside its load through
the module function `_get_filesystem_reader`, with no parameter for a reader of our own, so our strategy
swaps that one function for the duration of its own calls (under a lock; megatron-core 0.16). Nothing else
is patched, and nothing stays patched after the call.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import threading

import torch

from megaopd.models.hf_config import InputError

# (module, name) of every global torch DCP's .metadata is made of (torch 2.x). Dtypes are admitted by value
# (any torch.<name> that is a torch.dtype), not listed.
METADATA_GLOBALS = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name ('torch.strided')
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of a plain torch DCP save (a path, built from its parts)
        *(
            ("torch.distributed.checkpoint.metadata", n)
            for n in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        *(
            ("torch.distributed.checkpoint.planner", n)
            for n in (
                "SavePlan",
                "LoadPlan",
                "WriteItem",
                "WriteItemType",
                "ReadItem",
                "LoadItemType",
                "TensorWriteData",
                "BytesIOWriteData",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    }
)
_HOW = "load only checkpoints from a source you trust; megaopd's own hold nothing else"


class UnsafeCheckpointError(InputError):
    """A checkpoint file that pickles something its format never holds: loading it could run code."""


def _refusal(path: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} pickles {what}, which a checkpoint's metadata is never made of: "
        f"refused without loading it (it could run code); {_HOW}"
    )


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module, name):
        if (module, name) in METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise _refusal(self.path, f"{module}.{name}")


def read_metadata(path: str):
    """torch DCP's Metadata from a `.metadata` file, through the restricted unpickler."""
    with open(path, "rb") as f:
        try:
            return _MetadataUnpickler(f, path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle: name the file
            raise InputError(
                f"{path} is not readable torch DCP metadata ({type(e).__name__}: {e}); "
                f"the checkpoint is damaged: use an earlier one"
            ) from None


def _common_globals() -> list:
    from megatron.core.safe_globals import SAFE_GLOBALS

    return list(SAFE_GLOBALS)


def torch_load(f, path: str):
    """torch.load with weights_only=True (whatever the environment says) and megatron's safe globals only;
    a refused global becomes one line naming it and the file."""
    try:
        with torch.serialization.safe_globals(_common_globals()):
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        raise _refusal(path, found.group(1) if found else "an object torch's weights_only reader refuses") from None
    except (EOFError, RuntimeError, ValueError) as e:  # a truncated or garbled item: name the file
        raise InputError(
            f"{path} is not readable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'ends early'}); "
            f"the checkpoint is damaged: use an earlier one"
        ) from None


class _CheckedBytes:
    """The load planner as torch DCP's reader sees it, except load_bytes: each byte item is read with
    torch_load first, and reaches the planner's own (unrestricted) torch.load only when that succeeded."""

    def __init__(self, planner, source: str):
        self._planner, self._source = planner, source

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        torch_load(value, f"{self._source} (item {read_item.dest_index.fqn})")
        value.seek(0)
        self._planner.load_bytes(read_item, value)

    def __getattr__(self, name):
        return getattr(self._planner, name)


def _reader_class():
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(CachedMetadataFileSystemReader):
        """megatron's reader (metadata read once per load) with the restricted metadata and byte reads."""

        def read_metadata(self, *args, **kwargs):
            if self._cached_metadata is None:
                metadata = read_metadata(os.path.join(str(self.path), ".metadata"))
                if getattr(metadata, "storage_meta", None) is None:  # what torch's reader adds after pickle.load
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                self._cached_metadata = metadata
            return self._cached_metadata

        def read_data(self, plan, planner):
            return super().read_data(plan, _CheckedBytes(planner, str(self.path)))

    return SafeFileSystemReader


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _safe_readers():
    """megatron's torch_dist strategy builds its readers through this module function: ours, meanwhile."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    reader = _reader_class()
    with _PATCH_LOCK:
        original = mcore_torch._get_filesystem_reader
        mcore_torch._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: reader(checkpoint_dir)
        try:
            yield
        finally:
            mcore_torch._get_filesystem_reader = original


def _strategies():
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    class SafeTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict, checkpoint_dir):
            with _safe_readers():
                return super().load(sharded_state_dict, checkpoint_dir)

        def load_tensors_metadata(self, checkpoint_dir, metadata=None):
            with _safe_readers():
                return super().load_tensors_metadata(checkpoint_dir, metadata)

        def load_sharded_metadata(self, checkpoint_dir):
            with _safe_readers():
                return super().load_sharded_metadata(checkpoint_dir)

    class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            path = os.path.join(str(checkpoint_dir), "common.pt")
            if not os.path.isfile(path):
                return super().load_common(checkpoint_dir)  # megatron's own error for a missing file
            return torch_load(path, path)

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            raise InputError(
                f"{checkpoint_dir}: sharded objects outside the torch_dist shards are not read by "
                f"megaopd (a pickle per object); re-save the checkpoint with the torch_dist format"
            )

    return SafeTorchDistLoadStrategy(), SafeCommonLoadStrategy()


def saved_shapes(checkpoint_dir: str) -> dict[str, tuple[int, ...]]:
    """The global shape of every tensor a torch_dist folder holds, by its megatron name, from its `.metadata`
    (read restricted); {} without one."""
    path = os.path.join(checkpoint_dir, ".metadata")
    if not os.path.isfile(path):
        return {}
    items = getattr(read_metadata(path), "state_dict_metadata", None) or {}
    return {name: tuple(int(n) for n in meta.size) for name, meta in items.items() if hasattr(meta, "size")}


def check_shard_sizes(checkpoint_dir: str) -> None:
    """Every shard file as long as its `.metadata` says (the end of its last item): a truncated shard is one
    line naming the file and both sizes, before a byte of it is read (a checkpoint without a manifest has no
    other check; torch's reader would fail on it with a bare EOFError)."""
    metadata_path = os.path.join(checkpoint_dir, ".metadata")
    if not os.path.isfile(metadata_path):
        return  # megatron's own error names the missing metadata
    needed: dict[str, int] = {}
    for info in (getattr(read_metadata(metadata_path), "storage_data", None) or {}).values():
        name, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
        if isinstance(name, str):
            needed[name] = max(needed.get(name, 0), end)
    for name, end in sorted(needed.items()):
        path = os.path.join(checkpoint_dir, name)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size is None or size < end:
            what = "is missing" if size is None else f"is {size} bytes"
            raise InputError(
                f"{path} {what} but its .metadata says it holds {end}: the checkpoint is truncated or "
                f"incomplete; use an earlier one (or copy it again)"
            )


def load_safely(sharded_state_dict, checkpoint_dir: str):
    """megatron dist_checkpointing.load through the restricted readers (module docstring), after the shards'
    sizes are checked against the metadata (check_shard_sizes)."""
    from megatron.core import dist_checkpointing

    check_shard_sizes(str(checkpoint_dir))

    sharded, common = _strategies()
    return dist_checkpointing.load(sharded_state_dict, checkpoint_dir, sharded_strategy=sharded, common_strategy=common)


def check_pickles(checkpoint_dir: str) -> None:
    """The restricted reads of a torch_dist folder's `.metadata` and `common.pt`, without a model or ranks
    (command-line validation: one line before any worker starts). The shards' byte items are checked as the
    load reads them."""
    metadata = os.path.join(checkpoint_dir, ".metadata")
    if os.path.isfile(metadata):
        read_metadata(metadata)
        check_shard_sizes(checkpoint_dir)
    common = os.path.join(checkpoint_dir, "common.pt")
    if os.path.isfile(common):
        torch_load(common, common)
