"""HF <-> Megatron checkpoint conversion (the library behind tools/convert_*.py).

    hf_to_megatron(hf_dir, out_dir, tp=2, pp=2)   # a megaopd Megatron checkpoint, written at TP=2 PP=2
    hf_to_megatron(moe_dir, out_dir, tp=1, pp=1, ep=2)  # a MoE model's experts split over 2 EP ranks
    megatron_to_hf(ckpt_dir, out_dir)              # safetensors + config.json + tokenizer, HF-loadable
    megatron_to_hf(lora_ckpt, out_dir, lora_export="adapter")  # a LoRA student's peft adapter folder

Both validate everything they can from small files first (validate_*: config.json, the safetensors
headers, the layout, the output directory) and raise InputError with one line before megatron is
imported or a worker is started. Weights keep their dtype, so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from megaopd.models.hf_config import HFModelConfig, InputError, check_layout, read_hf_config
from megaopd.models.hf_io import safetensors_files

if TYPE_CHECKING:  # the groups module imports megatron: only the workers do (the module docstring says why)
    from megaopd.parallel.groups import Layout


def _check_out_dir(out_dir: str) -> None:
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise InputError(f"output directory {out_dir} is not empty; choose a new directory or empty it")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise InputError(f"output path {out_dir} exists and is not a directory")


def validate_hf_dir(hf_dir: str) -> tuple[HFModelConfig, dict[str, str]]:
    """Config + the safetensors name->file map, checked against each other (names only, no data read)."""
    from megaopd.models.weights import hf_shapes

    if not os.path.isdir(hf_dir):
        raise InputError(f"HF model directory {hf_dir} does not exist")
    cfg = read_hf_config(hf_dir)
    files = safetensors_files(hf_dir)
    missing = [n for n in hf_shapes(cfg) if n not in files]
    if missing:
        raise InputError(
            f"{hf_dir}: safetensors lack {len(missing)} tensors config.json implies "
            f"(first: {missing[0]}); the weights do not match config.json"
        )
    return cfg, files


def validate_hf_to_megatron(hf_dir: str, out_dir: str, tp: int, pp: int, ep: int = 1) -> HFModelConfig:
    from megaopd.models.ranks import check_world

    cfg, _ = validate_hf_dir(hf_dir)
    check_layout(cfg, tp, pp, ep)
    _check_out_dir(out_dir)
    check_world(tp * pp * ep)
    return cfg


def hf_dtype(hf_dir: str) -> str:
    """The weights' dtype as stored (config.json's claim can differ; exactness needs the real one)."""
    from megaopd.models.hf_io import HFWeights

    t = HFWeights(hf_dir)["model.embed_tokens.weight"]
    return str(t.dtype).replace("torch.", "")


def _hf_to_megatron_worker(rank: int, world: int, hf_dir: str, out_dir: str, layout: Layout, dtype: str):
    from megaopd.models.builder import BuildOptions, StageInfo, build_gpt_model
    from megaopd.models.checkpoint import save_model_checkpoint
    from megaopd.models.hf_io import HFWeights
    from megaopd.models.weights import Placement, load_hf_weights
    from megaopd.parallel.groups import initialize_actor_layout

    pgs = initialize_actor_layout(layout)
    cfg = read_hf_config(hf_dir)
    model = build_gpt_model(cfg, layout, pgs, BuildOptions(dtype=dtype, init_weights=False))
    st = StageInfo.of(pgs)
    place = Placement(
        tp_rank=st.tp_rank,
        tp_size=layout.tp,
        pp_rank=st.pp_rank,
        pp_size=layout.pp,
        ep_rank=pgs.ep.rank(),
        ep_size=layout.ep,
    )
    load_hf_weights(model, HFWeights(hf_dir), cfg, place)
    save_model_checkpoint(model, out_dir, cfg, pgs, hf_side_dir=hf_dir, extra_meta={"source": os.path.abspath(hf_dir)})
    return rank


def hf_to_megatron(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """Converts an HF Qwen2/Llama/Qwen3/Qwen3-MoE directory into a megaopd Megatron checkpoint written
    at TP=tp, PP=pp and, for a MoE model, EP=ep (tp * pp * ep ranks: the EP ranks are DP ranks)."""
    from megaopd.parallel.groups import Layout
    from megaopd.parallel.launch import run_on_ranks

    validate_hf_to_megatron(hf_dir, out_dir, tp, pp, ep)
    run_on_ranks(_hf_to_megatron_worker, tp * pp * ep, (hf_dir, out_dir, Layout(tp=tp, pp=pp, ep=ep), hf_dtype(hf_dir)))


LORA_EXPORTS = ("merged", "adapter")


def validate_megatron_to_hf(ckpt_dir: str, out_dir: str, tp: int = 1, pp: int = 1, lora_export: str = "merged"):
    from megaopd.models.checkpoint import check_checkpoint_collective, read_checkpoint_meta
    from megaopd.models.ranks import check_world
    from megaopd.models.safe_load import check_pickles, saved_shapes
    from megaopd.models.weights import check_config_matches_shards

    if not os.path.isdir(ckpt_dir):
        raise InputError(f"checkpoint directory {ckpt_dir} does not exist")
    meta = read_checkpoint_meta(ckpt_dir)
    if lora_export not in LORA_EXPORTS:
        raise InputError(f"--lora-export {lora_export}: choose {' or '.join(LORA_EXPORTS)}")
    if lora_export == "adapter" and not meta.get("lora"):
        raise InputError(
            f"{ckpt_dir} holds no LoRA adapters (its metadata has no 'lora'): --lora-export adapter is for a "
            "LoRA student's checkpoint; drop it to write the HF model"
        )
    check_checkpoint_collective(ckpt_dir)  # the manifest, then the pickles restricted: before any worker starts
    check_pickles(os.path.join(ckpt_dir, "model"))
    cfg = read_hf_config(ckpt_dir)
    check_config_matches_shards(saved_shapes(os.path.join(ckpt_dir, "model")), cfg, ckpt_dir)  # before the ranks
    check_layout(cfg, tp, pp)
    _check_out_dir(out_dir)
    check_world(tp * pp)
    return cfg


def _megatron_to_hf_worker(rank: int, world: int, ckpt_dir: str, out_dir: str, tp: int, pp: int, lora_export: str):
    import torch.distributed as dist

    from megaopd.models.builder import BuildOptions, apply_student_lora, build_gpt_model, torch_dtype
    from megaopd.models.checkpoint import load_model_checkpoint, read_checkpoint_meta
    from megaopd.models.config import LoRAConfig
    from megaopd.models.gather import gather_adapter_weights, gather_hf_weights, model_state
    from megaopd.models.hf_io import save_hf_dir, save_peft_adapter
    from megaopd.models.weights import adapted_linears
    from megaopd.parallel.groups import Layout, initialize_actor_layout

    pgs = initialize_actor_layout(Layout(tp, pp))
    cfg = read_hf_config(ckpt_dir)
    meta = read_checkpoint_meta(ckpt_dir)
    lora = LoRAConfig(**meta["lora"]) if meta.get("lora") else None
    options = BuildOptions(dtype=meta["dtype"], init_weights=False, use_te=False if lora else None)
    model = build_gpt_model(cfg, Layout(tp=tp, pp=pp), pgs, options)
    if lora is not None:  # the checkpoint holds base + adapters: rebuild the adapters, then load both
        apply_student_lora(model, cfg, lora, pgs, seed=0)
    load_model_checkpoint(model, ckpt_dir, pgs, verified=True)  # validate_megatron_to_hf checked it
    state = model_state(model)
    if lora_export == "adapter":
        tensors = gather_adapter_weights(state, cfg, pgs.tp, pgs.pp, dtype=torch_dtype(meta["dtype"]))
    else:  # a LoRA model's weights come merged, W + (alpha / r) B A
        tensors = gather_hf_weights(state, cfg, pgs.tp, pgs.pp, dtype=torch_dtype(meta["dtype"]))
    if dist.get_rank() == 0:
        # Streamed: rank 0 holds at most one ~4 GiB safetensors shard while the other ranks wait in the
        # next gather. config.json and tokenizer files are copied verbatim from the checkpoint.
        if lora_export == "adapter":
            base = meta.get("base_model") or meta.get("source") or ""
            save_peft_adapter(out_dir, tensors, lora.rank, lora.alpha, adapted_linears(state), base, lora.dropout)
        else:
            save_hf_dir(out_dir, tensors, side_files_from=ckpt_dir)
    else:
        for _ in tensors:  # collective: every rank takes part in each gather/broadcast
            pass
    dist.barrier()
    return rank


def megatron_to_hf(ckpt_dir: str, out_dir: str, tp: int = 1, pp: int = 1, lora_export: str = "merged") -> None:
    """Writes an HF directory (safetensors, config.json, tokenizer) from a megaopd Megatron checkpoint.

    The checkpoint is loaded at TP=tp, PP=pp (default one process, whatever layout it was saved at); a
    MoE checkpoint written at any EP is loaded with all experts on each rank (EP=1: dist_checkpointing
    reshards the experts), so the PP broadcast of gather_hf_weights collects every tensor on rank 0.
    A LoRA student's checkpoint (metadata 'lora'): lora_export "merged" writes the HF model with W + (alpha / r)
    B A; "adapter" writes a peft adapter folder (adapter_config.json, adapter_model.safetensors) for its base.
    """
    from megaopd.parallel.launch import run_on_ranks

    validate_megatron_to_hf(ckpt_dir, out_dir, tp, pp, lora_export)
    run_on_ranks(_megatron_to_hf_worker, tp * pp, (ckpt_dir, out_dir, tp, pp, lora_export))
