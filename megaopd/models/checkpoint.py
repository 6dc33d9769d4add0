"""Megatron model checkpoints: megatron-core dist_checkpointing (torch_dist) + HF side files + metadata.

    save_model_checkpoint(model, ckpt_dir, cfg, pg_collection, hf_side_dir=hf_dir)   # every rank calls
    load_model_checkpoint(model, ckpt_dir, pg_collection)                            # any TP/PP layout

A checkpoint directory:
    megaopd_checkpoint.json   {"format": "megaopd-megatron", "version": 1, "tp", "pp", "ep", "dtype", ...}
    config.json, tokenizer*   the HF files of the model (so the checkpoint alone describes it)
    model/                    dist_checkpointing of model.sharded_state_dict()
Because dist_checkpointing stores global tensors with their shard offsets, a checkpoint written at
TP=2 PP=2 loads at TP=1 PP=1 (or any layout check_layout accepts). The vocabulary padding differs per
TP (a multiple of 128 * TP); a MoE model's experts are stored as global experts, so EP reshards too
("ep" records the saving layout, for the reader; megatron marks the embedding and output layer `allow_shape_mismatch`, so
the stored rows are read and any extra padding rows start at zero).
The torch_dist format reads its own metadata with pickle: load only checkpoints you (or megaopd) wrote.
Entry scripts that save need an `if __name__ == "__main__":` guard: the writer processes re-import it.
megatron is imported inside the functions: reading metadata stays cheap for command-line validation.
"""
from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as dist

from megaopd.models.hf_config import HFModelConfig, ModelConfigError, read_hf_config
from megaopd.models.hf_io import copy_side_files

META_NAME = "megaopd_checkpoint.json"
MODEL_SUBDIR = "model"
FORMAT = "megaopd-megatron"


def is_megatron_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_NAME))


def read_checkpoint_meta(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, META_NAME)
    if not os.path.isfile(path):
        raise ModelConfigError(f"{ckpt_dir} is not a megaopd Megatron checkpoint (no {META_NAME}); "
                               "make one with tools/convert_hf_to_megatron.py")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ModelConfigError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if not os.path.isdir(os.path.join(ckpt_dir, MODEL_SUBDIR)):
        raise ModelConfigError(f"{ckpt_dir} has metadata but no {MODEL_SUBDIR}/ weights; the save did not finish")
    return meta


def read_checkpoint_config(ckpt_dir: str) -> HFModelConfig:
    read_checkpoint_meta(ckpt_dir)
    return read_hf_config(ckpt_dir)


def save_model_checkpoint(model, ckpt_dir: str, cfg: HFModelConfig, pg_collection=None,
                          hf_side_dir: str | None = None, extra_meta: dict | None = None) -> None:
    """Collective over all ranks: writes the model's shards, then rank 0 writes config + metadata.

    hf_side_dir: a directory whose config.json and tokenizer files are copied in (default: write
    cfg.raw as config.json and no tokenizer).
    """
    from megatron.core import dist_checkpointing

    from megaopd.models import compat

    pgs = compat.resolve_pg_collection(pg_collection)
    model_dir = os.path.join(ckpt_dir, MODEL_SUBDIR)
    if dist.get_rank() == 0:
        os.makedirs(model_dir, exist_ok=True)
    dist.barrier()
    compat.start_checkpoint_results_queue()
    dist_checkpointing.save(compat.sharded_state_dict(model, pgs), model_dir)
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
            **(extra_meta or {}),
        }
        # Metadata last: its presence marks a finished checkpoint.
        tmp = os.path.join(ckpt_dir, META_NAME + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=2)
        os.replace(tmp, os.path.join(ckpt_dir, META_NAME))
    dist.barrier()


def saved_ep(pgs) -> int:
    """The expert-parallel size of a layout's groups (1 for a dense model or a collection without EP)."""
    group = getattr(pgs, "ep", None)
    return group.size() if group is not None else 1


def load_model_checkpoint(model, ckpt_dir: str, pg_collection=None) -> dict:
    """Collective: loads this rank's shard of every tensor into `model` (any layout); returns the metadata."""
    from megatron.core import dist_checkpointing

    from megaopd.models import compat

    meta = read_checkpoint_meta(ckpt_dir)
    pgs = compat.resolve_pg_collection(pg_collection)
    state = dist_checkpointing.load(compat.sharded_state_dict(model, pgs), os.path.join(ckpt_dir, MODEL_SUBDIR))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # _extra_state entries (TE) may legitimately be absent; real parameters may not.
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"checkpoint {ckpt_dir} lacks {missing[:4]} ({len(missing)} tensors)")
    return meta


def checkpoint_dtype(meta: dict) -> torch.dtype:
    from megaopd.models.builder import torch_dtype

    return torch_dtype(meta.get("dtype", "float32"))
