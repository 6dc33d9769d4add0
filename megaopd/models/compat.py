"""Everything in megaopd.models that depends on the megatron-core version or on optional GPU packages.

Written against megatron-core 0.16.1. When megatron changes a name or a signature, this is the one file
to edit: layer specs (Transformer Engine vs local), the final-norm choice of TransformerBlock, RoPE
arguments, sharded_state_dict metadata and the pipeline schedule call.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megaopd.parallel.groups import ACTOR_PGS


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def use_transformer_engine_default() -> bool:
    """TE only where it can run: importable and a GPU present. Otherwise megatron-core's local spec."""
    return torch.cuda.is_available() and have_transformer_engine()


def decoder_block_spec(
    use_te: bool, num_local_layers: int, qk_layernorm: bool = False, num_experts: int | None = None
) -> TransformerBlockSubmodules:
    """The layer recipe (RMSNorm, SwiGLU MLP or routed experts, fused QKV with RoPE, optional per-head
    q/k RMSNorm) and the block's final norm.

    We build the block spec ourselves rather than passing a layer ModuleSpec: for a layer spec
    TransformerBlock picks its final norm from what is installed (TENorm, else apex FusedLayerNorm,
    else torch), and apex's FusedLayerNorm asserts normalization == "LayerNorm", so a machine with apex
    but no TE could not build an RMSNorm model. Here the final norm is the same module as the layers'
    own norms: TENorm with TE (supports RMSNorm), WrappedTorchNorm (torch.nn.RMSNorm) otherwise.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        layer = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm
        )
        final_norm: Any = TENorm
    else:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        layer = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm, normalization="RMSNorm"
        )
        layer = _with_packed_core_attention(layer)
        final_norm = WrappedTorchNorm
    assert isinstance(layer, ModuleSpec)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_local_layers, layer_norm=final_norm)


def _with_packed_core_attention(layer: ModuleSpec) -> ModuleSpec:
    """The local layer spec with megaopd's PackedDotProductAttention as core attention: megatron's local
    DotProductAttention refuses packed sequences (THD); TE's spec takes them already."""
    import copy

    from megaopd.models.packed_attention import PackedDotProductAttention

    layer = copy.deepcopy(layer)
    layer.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return layer


def patch_moe_router_without_te() -> None:
    """megatron-core 0.16.1's router GEMM tests `te_general_gemm is not None`, but moe_utils binds that
    name only when Transformer Engine imports: without TE every MoE forward raises NameError. Bind it
    to None (the torch.mm path) when TE is absent. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def start_checkpoint_results_queue(method: str | None = None) -> None:
    """Starts, before a process's first save, the multiprocessing Manager through which megatron-core 0.16's
    torch_dist writer hands back each save's write results (megatron starts it itself at the first save, with
    the spawn method). Two things differ from megatron's own start:

    - Preemption signals (SIGTERM, SIGUSR1) are blocked while it starts, so the Manager runs with them
      blocked. srun delivers the time-limit warning to every process of the step, the Manager included; a
      Manager killed by it broke the checkpoint the ranks then saved (BrokenPipeError). Blocked, a signal that
      reaches the rank meanwhile waits and is delivered when the start is over.
    - method: "fork" by default on a machine without CUDA, as megatron starts its writer processes: a spawned
      Manager is a fresh interpreter that imports torch to unpickle the first result, ~4 s of a 2-core CPU
      per saving process (every rank of a run, every test worker, every converter). Where CUDA is present,
      megatron's spawn stays (a CUDA process is not forked where it can be avoided; the cost there is once per
      run).

    Idempotent; leaves megatron alone where its names are gone (another megatron version)."""
    import multiprocessing
    import signal

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is not None:
        return
    method = method or ("spawn" if torch.cuda.is_available() else "fork")
    # A spawn starts multiprocessing's resource tracker first if it is not running, and that start unblocks
    # SIGTERM on its way out: start it before the block (a running tracker is left alone).
    if method != "fork":
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
    try:  # what megatron's _get_write_results_queue does, with `method` for its "spawn"
        filesystem_async._results_queue = multiprocessing.get_context(method).Manager().Queue()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def cpu_config_overrides() -> dict:
    """TransformerConfig fields for the CPU path: host-side init, no CUDA-only fusions."""
    return dict(
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def rope_kwargs(rope_theta: float, llama3_factor: float | None) -> dict:
    """GPTModel RoPE arguments. rotary_base is annotated int in 0.16; real thetas are integral."""
    base: float | int = int(rope_theta) if float(rope_theta).is_integer() else rope_theta
    kw: dict = dict(position_embedding_type="rope", rotary_percent=1.0, rotary_base=base)
    if llama3_factor is not None:
        kw.update(rope_scaling=True, rope_scaling_factor=llama3_factor)
    return kw


def resolve_pg_collection(pg_collection: ProcessGroupCollection | None) -> ProcessGroupCollection:
    """The explicit groups, or those of megatron's global parallel_state (the actor's layout)."""
    if pg_collection is not None:
        return pg_collection
    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=ACTOR_PGS)


def sharded_state_dict(model, pg_collection: ProcessGroupCollection) -> dict:
    """model.sharded_state_dict with the DP group given explicitly (0.16 reads parallel_state otherwise)."""
    return model.sharded_state_dict(metadata={"dp_cp_group": pg_collection.dp_cp})


def init_optimizer_states_for_loading(optimizer) -> None:
    """Gives a fresh distributed optimizer's inner torch Adam its state tensors (and `step`) before a
    checkpoint is loaded into it. Without Apex or Transformer Engine, megatron-core 0.16's
    DistributedOptimizer.state_dict() reads `step` from the inner optimizer's per-parameter state and asserts
    there is exactly one value; a fresh optimizer has none, so resuming fails on a GPU.
    megatron's own remedy (used for its FSDP layout) takes one zero-gradient step; everything it touches
    (main parameters, moments, step) is then overwritten by the load. The model's own weights are not
    touched (the inner optimizer holds the float32 main copies)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None and not opt.optimizer.state:
            init()


def forward_backward_func(pg_collection: ProcessGroupCollection):
    """The pipeline schedule for the collection's PP size, and the keyword arguments it needs.

    Passing the P2P communicator and the collection makes the schedule use these groups, never the
    global parallel_state; so a teacher at its own TP/PP runs through the same code as the actor.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    pp_size = pg_collection.pp.size()
    fn = get_forward_backward_func(pp_size=pp_size, vp_size=None)

    def call(model, **kwargs):
        extra = {}
        if pp_size > 1:
            extra["p2p_communicator"] = P2PCommunicator(pp_group=pg_collection.pp, config=model.config)
        return fn(model=model, pg_collection=pg_collection, **extra, **kwargs)

    return call


def make_transformer_config(**kwargs) -> TransformerConfig:
    # megatron 0.16's default cuda_graph_scope "full" is deprecated in its own __post_init__ (a warning on
    # every config); [] is its documented equivalent (the whole layer).
    kwargs.setdefault("cuda_graph_scope", [])
    return TransformerConfig(**kwargs)


def mark_tensor_parallel_params(model: torch.nn.Module) -> None:
    """Sets megatron's partition attributes (tensor_model_parallel, partition_dim, partition_stride) on
    the TP-split weights of a model built with perform_initialization=False.

    megatron-core 0.16 sets them only inside its random-init functions, so a model built without
    init (to load weights) has none; every TP rank but 0 then treats its shards as duplicates of
    rank 0's, and the gradient norm (hence clipping) and anything else that filters duplicates come
    out wrong at TP > 1. Linear biases already have them.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or getattr(weight, "tensor_model_parallel", False):
            continue
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            set_tensor_model_parallel_attributes(weight, True, 0, getattr(module, "stride", 1))
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, getattr(module, "stride", 1))
