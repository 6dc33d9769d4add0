"""Megatron model checkpoints: megatron-core dist_checkpointing (torch_dist) + HF side files + metadata.

    save_model_checkpoint(model, ckpt_dir, cfg, pg_collection, hf_side_dir=hf_dir)   # every rank calls
    load_model_checkpoint(model, ckpt_dir, pg_collection)                            # any TP/PP layout

A checkpoint directory:
    megaopd_checkpoint.json   {"format": "megaopd-megatron", "version": 1, "tp", "pp", "ep", "dtype", ...}
    config.json, tokenizer*   the HF files of the model (so the checkpoint alone describes it)
    model/                    dist_checkpointing of model.sharded_state_dict()
    manifest.json             every other file's size and sha256 (megaopd.models.manifest), written last
Because dist_checkpointing stores global tensors with their shard offsets, a checkpoint written at
TP=2 PP=2 loads at TP=1 PP=1 (or any layout check_layout accepts). The vocabulary padding differs per
TP (a multiple of 128 * TP); a MoE model's experts are stored as global experts, so EP reshards too
("ep" records the saving layout, for the reader; megatron marks the embedding and output layer
`allow_shape_mismatch`, so
the stored rows are read and any extra padding rows start at zero).
Loading verifies the manifest before a byte of state is read (a changed, truncated, missing or added file is
named in one line), then reads the torch_dist pickles through megaopd.models.safe_load's restricted readers.
A checkpoint without a manifest (an older megaopd, another tool) still loads, through the same restricted
readers, with one line saying it is unverified (docs/run_folder.md).
Entry scripts that save need an `if __name__ == "__main__":` guard: the writer processes re-import it.
megatron is imported inside the functions: reading metadata stays cheap for command-line validation.
"""

from __future__ import annotations

import datetime
import json
import os

import torch.distributed as dist

from megaopd.models.hf_config import HFModelConfig, ModelConfigError
from megaopd.models.hf_io import copy_side_files
from megaopd.models.manifest import (
    MANIFEST,
    FileRecord,
    ManifestError,
    hash_files,
    list_files,
    read_manifest,
    verify,
    write_manifest,
)

META_NAME = "megaopd_checkpoint.json"
MODEL_SUBDIR = "model"
FORMAT = "megaopd-megatron"


def is_megatron_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_NAME))


def saved_lora(path: str, role: str, wanted, trainable: bool):
    """The LoRAConfig a model at `path` must carry before its weights load: a megaopd checkpoint of a LoRA student
    (metadata 'lora') holds base + adapters, so they are rebuilt from its metadata first and never silently
    dropped; None for an HF directory or a checkpoint without adapters. wanted: the role's LoRAConfig (None when
    off). ValueError (one line) when a trained role's student.lora is off or differs from the saved adapters."""
    from megaopd.models.config import LoRAConfig
    from megaopd.models.lora import target_linears

    if not is_megatron_checkpoint(path):
        return None
    meta = read_checkpoint_meta(path).get("lora")
    if not meta:
        return None
    saved = LoRAConfig(**meta)
    if trainable and wanted is None:
        raise ValueError(
            f"{role}.path={path} is a LoRA checkpoint (rank {saved.rank}, targets {list(saved.targets)}): set "
            f"{role}.lora.enabled=true with rank={saved.rank} alpha={saved.alpha:g} targets={list(saved.targets)} to "
            "go on training its adapters, or export it merged first (tools/convert_megatron_to_hf.py --lora-export "
            "merged) to train every weight"
        )
    if wanted is not None and (wanted.rank, wanted.alpha, target_linears(wanted.targets)) != (
        saved.rank,
        saved.alpha,
        target_linears(saved.targets),
    ):
        raise ValueError(
            f"{role}.lora (rank {wanted.rank}, alpha {wanted.alpha:g}, targets {list(wanted.targets)}) differs from "
            f"the adapters saved in {role}.path={path} (rank {saved.rank}, alpha {saved.alpha:g}, targets "
            f"{list(saved.targets)}): set {role}.lora to the saved ones"
        )
    return saved if wanted is None else wanted


def base_model_of(path: str) -> str:
    """What a LoRA student's adapters apply to, for peft's base_model_name_or_path: the HF directory it started
    from (absolute), or for a megaopd checkpoint the base its metadata names (base_model, else the converted
    source), else the checkpoint itself."""
    if is_megatron_checkpoint(path):
        meta = read_checkpoint_meta(path)
        return meta.get("base_model") or meta.get("source") or os.path.abspath(path)
    return os.path.abspath(path)


def read_checkpoint_meta(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, META_NAME)
    if not os.path.isfile(path):
        raise ModelConfigError(
            f"{ckpt_dir} is not a megaopd Megatron checkpoint (no {META_NAME}); "
            "make one with tools/convert_hf_to_megatron.py"
        )
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ModelConfigError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if not os.path.isdir(os.path.join(ckpt_dir, MODEL_SUBDIR)):
        raise ModelConfigError(f"{ckpt_dir} has metadata but no {MODEL_SUBDIR}/ weights; the save did not finish")
    return meta


def save_model_checkpoint(
    model,
    ckpt_dir: str,
    cfg: HFModelConfig,
    pg_collection=None,
    hf_side_dir: str | None = None,
    extra_meta: dict | None = None,
    manifest: bool = True,
) -> None:
    """Collective over all ranks: writes the model's shards, then rank 0 writes config + metadata, then
    (manifest=True) the manifest of it all. A caller that adds files of its own (a training checkpoint)
    passes manifest=False and calls write_checkpoint_manifest when it has written them.

    hf_side_dir: a directory whose config.json and tokenizer files are copied in (default: write
    cfg.raw as config.json and no tokenizer).
    """
    from megatron.core import dist_checkpointing

    from megaopd.models import compat
    from megaopd.models.lora import lora_meta

    pgs = compat.resolve_pg_collection(pg_collection)
    model_dir = os.path.join(ckpt_dir, MODEL_SUBDIR)
    if dist.get_rank() == 0:
        os.makedirs(model_dir, exist_ok=True)
    dist.barrier()
    compat.start_checkpoint_results_queue()
    dist_checkpointing.save(compat.sharded_state_dict(model, pgs), model_dir)
    lora = lora_meta(model)  # a LoRA model's shards hold base + adapters: the metadata says how to rebuild them
    if dist.get_rank() == 0:
        if hf_side_dir is not None:
            copy_side_files(hf_side_dir, ckpt_dir)
        else:
            with open(os.path.join(ckpt_dir, "config.json"), "w") as f:
                json.dump(dict(cfg.raw), f, indent=2)
        dtype = model.config.params_dtype  # not a parameter's: local-spec norms stay float32
        meta = {
            "format": FORMAT,
            "version": 1,
            "tp": pgs.tp.size(),
            "pp": pgs.pp.size(),
            "ep": saved_ep(pgs),
            "dtype": str(dtype).replace("torch.", ""),
            "architecture": cfg.architecture,
            "vocab_size": cfg.vocab_size,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **({"lora": lora} if lora else {}),
            **(extra_meta or {}),
        }
        # Metadata last: its presence marks a finished checkpoint.
        tmp = os.path.join(ckpt_dir, META_NAME + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=2)
        os.replace(tmp, os.path.join(ckpt_dir, META_NAME))
    dist.barrier()
    if manifest:
        write_checkpoint_manifest(ckpt_dir, (extra_meta or {}).get("step"))


def write_checkpoint_manifest(ckpt_dir: str, step: int | None) -> None:
    """Collective, after every file of the checkpoint is written: each rank hashes its share of the files,
    rank 0 writes manifest.json (atomically, last)."""
    from megaopd.parallel.dist import rank0_computes

    files = rank0_computes(list_files, ckpt_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    shares: list[list[FileRecord] | None] = [None] * world
    dist.all_gather_object(shares, hash_files(ckpt_dir, files[rank::world]))  # our own records
    if rank == 0:
        write_manifest(ckpt_dir, [r for share in shares for r in share], step)
    dist.barrier()


# A training step's files that no model load reads: a model path or a converter verifies the rest.
TRAINING_ONLY = ("optimizer", "rng", "trainer_state.json")


def check_checkpoint(ckpt_dir: str, skip: tuple[str, ...] = TRAINING_ONLY) -> str | None:
    """Raises ManifestError naming the first file that differs from the manifest; returns None when it
    verifies, or the one line to show when the checkpoint has no manifest (loaded unverified)."""
    if read_manifest(ckpt_dir) is None:
        return (
            f"{ckpt_dir} has no {MANIFEST} (written by an older megaopd or another tool): loading it "
            f"unverified, its pickles through the restricted reader"
        )
    problem = verify(ckpt_dir, skip)
    if problem is not None:
        raise ManifestError(
            f"checkpoint {ckpt_dir} does not verify: {problem}; restore the file or use another checkpoint"
        )
    return None


def check_checkpoint_collective(ckpt_dir: str, skip: tuple[str, ...] = TRAINING_ONLY) -> None:
    """check_checkpoint on rank 0, its verdict raised on every rank (collective; plain call without ranks)."""
    from megaopd.parallel.dist import rank0_computes

    def verdict():
        try:
            return ("ok", check_checkpoint(ckpt_dir, skip))
        except ManifestError as e:
            return ("error", str(e))

    kind, line = rank0_computes(verdict) if dist.is_initialized() else verdict()
    if kind == "error":
        raise ManifestError(line)
    if line and (not dist.is_initialized() or dist.get_rank() == 0):
        print(line, flush=True)


def saved_ep(pgs) -> int:
    """The expert-parallel size of a layout's groups (1 for a dense model or a collection without EP)."""
    group = getattr(pgs, "ep", None)
    return group.size() if group is not None else 1


def load_model_checkpoint(model, ckpt_dir: str, pg_collection=None, verified: bool = False) -> dict:
    """Collective: loads this rank's shard of every tensor into `model` (any layout); returns the metadata.
    The manifest is checked first unless the caller did (verified=True); the pickles are read restricted."""
    from megaopd.models import compat
    from megaopd.models.safe_load import load_safely

    meta = read_checkpoint_meta(ckpt_dir)
    if not verified:
        check_checkpoint_collective(ckpt_dir)
    pgs = compat.resolve_pg_collection(pg_collection)
    state = load_safely(compat.sharded_state_dict(model, pgs), os.path.join(ckpt_dir, MODEL_SUBDIR))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # _extra_state entries (TE) may legitimately be absent; real parameters may not.
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"checkpoint {ckpt_dir} lacks {missing[:4]} ({len(missing)} tensors)")
    return meta
