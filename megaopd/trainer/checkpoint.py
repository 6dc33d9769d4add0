"""Training checkpoints: RUN/checkpoints/step_NNNNNN/ with an atomic RUN/checkpoints/latest pointer.

    step_000010/             a complete megaopd model checkpoint of the student (megaopd.models.checkpoint):
      model/                 megatron dist_checkpointing (torch_dist), loadable at another TP/PP
      config.json, tokenizer files, megaopd_checkpoint.json
                             so `megaopd eval --ckpt`, `megaopd logprobs`, convert_megatron_to_hf.py and
                             `student.path=` all take it as it is
      optimizer/             Adam state (dist_checkpointing, sharded like the model)
      trainer_state.json     step, world size, the actor's layout {tp, pp, ep}; each Stateful component's
                             state under its key (lr scheduler, data position, collapse detector); metadata
                             for people and tools (weight version, model paths), never read back
      rng/rank_R.safetensors each rank's torch RNG state (uint8 tensors, no pickle)
      manifest.json          every other file's size and sha256 and the step (megaopd.models.manifest), last

A checkpoint is written under a temporary name, its manifest last, and renamed when every rank has finished,
then `latest` is replaced atomically: a run killed mid-save resumes from the previous complete checkpoint.
Which step a run resumes from, and what a start over moves aside: megaopd.trainer.run_folder. Pruning keeps
the newest `keep` complete steps by the step they record and never the one just written; it deletes only
folders with a manifest (docs/run_folder.md).

The trainer's small state travels as Stateful components (torchtitan's pattern): the trainer builds one
Checkpointer after every component exists, so save and resume read the same {key: object} mapping, each key is
named in one place and each object says what it keeps.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Mapping, Protocol

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from safetensors.torch import load_file, save_file

from megaopd.models import compat
from megaopd.models.checkpoint import load_model_checkpoint, save_model_checkpoint, saved_ep, write_checkpoint_manifest
from megaopd.models.manifest import read_manifest
from megaopd.models.safe_load import load_safely
from megaopd.trainer.run_folder import LATEST, RunFolderError, StepFolder, checkpoints_dir, step_folders


class Stateful(Protocol):
    """What a checkpoint restores of one object besides the model, the optimizer and the RNG."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def trainer_state(
    step: int, world_size: int, layout: dict, components: Mapping[str, Stateful], meta: Mapping[str, object]
) -> dict:
    """trainer_state.json's contents: step, world size and layout (read back on resume), then each component's
    state_dict() under its key, then `meta` (for people and tools; never read back)."""
    clash = ({"step", "world_size", "layout"} | set(components)) & set(meta)
    if clash:
        raise ValueError(f"checkpoint metadata keys {sorted(clash)} would overwrite saved state")
    return {
        "step": step,
        "world_size": world_size,
        "layout": layout,
        **{key: c.state_dict() for key, c in components.items()},
        **meta,
    }


def restore_components(state: dict, components: Mapping[str, Stateful], path: str) -> int:
    """Loads each component from its key of trainer_state.json's contents; returns the saved step."""
    missing = [key for key in components if key not in state]
    if missing:
        raise ValueError(
            f"{path}/trainer_state.json has no state for {missing}: it was written by another "
            f"version of megaopd; start a new run.dir"
        )
    for key, c in components.items():
        c.load_state_dict(state[key])
    return int(state["step"])


# The distributed optimizer's checkpoint layout. megatron-core 0.16's default, 'fully_sharded_model_space', is
# deprecated and its ShardedTensors carry flattened_range, which its own validation now refuses: the first
# save of a run with optimizer.use_distributed_optimizer=true fails on a GPU. 'dp_reshardable'
# (Megatron-LM's default) saves each rank's buffers as they are, in parallel, with no gather; a run may
# resume with another data-parallel size, not another TP/PP layout. The plain optimizer ignores the key.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _optimizer_sd(model, optimizer, pgs, is_loading: bool) -> dict:
    return {
        "optimizer": optimizer.sharded_state_dict(
            compat.sharded_state_dict(model, pgs), is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA)
        )
    }


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


@dataclass(kw_only=True)
class Checkpointer:
    """What a checkpoint saves and restores, named once, after every component exists (torchtitan's
    Checkpointer): the student, its optimizer and layout, and the Stateful components under their keys; save
    and load read the same mapping."""

    run_dir: str
    model: torch.nn.Module
    """The student (its stage on this rank)."""
    optimizer: object
    pgs: object
    """The student's ProcessGroupCollection."""
    components: Mapping[str, Stateful]
    """The trainer's small state by key (scheduler, data position, collapse detector, loss controller)."""
    hf_cfg: object
    """The student's architecture (its HFModelConfig), written beside the weights."""
    hf_side_dir: str
    """The directory whose config.json and tokenizer files are copied in."""
    keep: int = 2
    """Complete steps kept (the newest by the step they record; _prune)."""
    model_meta: Mapping[str, object] = field(default_factory=dict)
    """What the model's metadata records besides the step (a LoRA student: base_model, the HF base its adapters
    apply to, which a peft export names as base_model_name_or_path)."""

    def save(self, step: int, meta: Mapping[str, object]) -> str:
        """Collective: every rank calls it. Returns the checkpoint directory. The components' state is rank 0's
        (they are the same on every rank); meta: what trainer_state.json records for people and tools."""
        run_dir, model, optimizer, pgs = self.run_dir, self.model, self.optimizer, self.pgs
        rank = dist.get_rank()
        name = f"step_{step:06d}"
        final = os.path.join(checkpoints_dir(run_dir), name)
        tmp = final + ".tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # an unfinished save of this step: never a complete one
            os.makedirs(os.path.join(tmp, "optimizer"))
            os.makedirs(os.path.join(tmp, "rng"))
        dist.barrier()
        save_model_checkpoint(
            model,
            tmp,
            self.hf_cfg,
            pgs,
            hf_side_dir=self.hf_side_dir,
            extra_meta={"step": step, **self.model_meta},
            manifest=False,
        )
        dist_checkpointing.save(_optimizer_sd(model, optimizer, pgs, is_loading=False), os.path.join(tmp, "optimizer"))
        save_file(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.safetensors"))
        dist.barrier()
        if rank == 0:
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                layout = {"tp": pgs.tp.size(), "pp": pgs.pp.size(), "ep": saved_ep(pgs)}
                json.dump(trainer_state(step, dist.get_world_size(), layout, self.components, meta), f, indent=1)
        write_checkpoint_manifest(tmp, step)  # collective; last: its presence marks a finished step
        if rank == 0:
            if os.path.exists(final):  # a folder of this name from another timeline: kept, not overwritten
                _set_aside(run_dir, name)
            os.replace(tmp, final)
            pointer_tmp = os.path.join(checkpoints_dir(run_dir), LATEST + ".tmp")
            with open(pointer_tmp, "w") as f:
                f.write(name)
            os.replace(pointer_tmp, os.path.join(checkpoints_dir(run_dir), LATEST))
            _prune(run_dir, self.keep, just_written=name)
        dist.barrier()
        return final

    def load(self, path: str, restore_rng: bool = True) -> int:
        """Collective. Loads weights, optimizer state and every component in place; returns the saved step.
        `path` comes from run_folder.resume_point, which verified its manifest: the pickles are read restricted."""
        model, optimizer, pgs = self.model, self.optimizer, self.pgs
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        manifest = read_manifest(path)
        if manifest is not None and int(state.get("step", -1)) != manifest.step:
            raise RunFolderError(
                f"{path}/trainer_state.json records step {state.get('step')} but its manifest.json step "
                f"{manifest.step}: the folder was edited; restore it, or resume from another step folder"
            )
        load_model_checkpoint(model, path, pgs, verified=True)
        if optimizer is not None:
            compat.init_optimizer_states_for_loading(optimizer)
            loaded = load_safely(_optimizer_sd(model, optimizer, pgs, is_loading=True), os.path.join(path, "optimizer"))
            optimizer.load_state_dict(loaded["optimizer"])
        rng_file = os.path.join(path, "rng", f"rank_{dist.get_rank()}.safetensors")
        if restore_rng and state.get("world_size") == dist.get_world_size() and os.path.exists(rng_file):
            rng = load_file(rng_file)
            torch.set_rng_state(rng["torch_cpu"])
            if torch.cuda.is_available() and "torch_cuda" in rng:
                torch.cuda.set_rng_state(rng["torch_cuda"])
        return restore_components(state, self.components, path)


def _set_aside(run_dir: str, name: str) -> None:
    aside = os.path.join(checkpoints_dir(run_dir), f"old_{name}_{int(time.time())}")
    os.replace(os.path.join(checkpoints_dir(run_dir), name), aside)


def _prune(run_dir: str, keep: int, just_written: str) -> None:
    """Deletes complete steps (manifest present, every file at its size) beyond the newest `keep` by their
    recorded step; never `just_written`, never a folder without a manifest (not known to be ours or complete)."""
    if keep <= 0:
        return
    folders, _ = step_folders(run_dir)
    complete = [f for f in folders if f.manifest is not None and _sizes_match(run_dir, f)]
    kept = {f.name for f in complete[:keep]} | {just_written}
    for f in complete:
        if f.name not in kept:
            shutil.rmtree(os.path.join(checkpoints_dir(run_dir), f.name), ignore_errors=True)


def _sizes_match(run_dir: str, folder: StepFolder) -> bool:
    root = os.path.join(checkpoints_dir(run_dir), folder.name)
    for record in folder.manifest.files:
        path = os.path.join(root, record.path)
        if not os.path.isfile(path) or os.path.getsize(path) != record.size:
            return False
    return True
