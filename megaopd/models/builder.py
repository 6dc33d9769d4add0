"""HF config -> megatron-core TransformerConfig and GPTModel (one pipeline stage of it).

    from megaopd.models.builder import build_gpt_model
    model = build_gpt_model(read_hf_config(hf_dir), Layout(tp=2))                 # actor: parallel_state
    teacher = build_gpt_model(cfg_t, Layout(tp=4), pg_collection=teacher_pgs)      # teacher: own groups
    frozen = build_gpt_model(cfg, Layout(), pgs, BuildOptions(dtype="bfloat16", init_weights=False))

Parallel sizes enter only through TransformerConfig; the model's groups come from `pg_collection`
(None -> megatron's global parallel_state, set by megaopd.parallel.groups.initialize_actor_layout).
The stage (pre_process / post_process and which layers) is derived from the collection's PP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

from megaopd.models import compat
from megaopd.models.config import LoRAConfig
from megaopd.models.hf_config import HFModelConfig, check_layout, layers_per_stage, padded_vocab_size
from megaopd.parallel.groups import Layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class StageInfo:
    """Where this rank's model sits in its layout."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int

    @property
    def pre_process(self) -> bool:
        return self.pp_rank == 0

    @property
    def post_process(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def of(cls, pg_collection: ProcessGroupCollection) -> "StageInfo":
        return cls(pg_collection.tp.rank(), pg_collection.tp.size(), pg_collection.pp.rank(), pg_collection.pp.size())


def moe_token_dispatcher() -> str:
    """megatron's MoE token dispatcher: "alltoall" on GPU, "allgather" on CPU.

    "alltoall" sends each token only to the EP ranks holding its experts (the usual choice at EP > 1),
    but megatron-core 0.16's MoEAlltoAllTokenDispatcher creates a torch.cuda.Stream in its constructor
    (for the device-to-host copy of the token counts), so it cannot even be built without CUDA.
    "allgather" all-gathers every token and its routing over the TP x EP group and reduce-scatters
    the expert outputs back: only all_gather / reduce_scatter, which gloo has, so it runs on CPU.
    """
    return "alltoall" if torch.cuda.is_available() else "allgather"


def moe_config(cfg: HFModelConfig, ep: int, train_router: bool) -> dict:
    """TransformerConfig fields of a Qwen3-MoE model: dropless top-k routing, no shared expert.

    HF Qwen3-MoE takes softmax over all experts, keeps the top k and (norm_topk_prob) renormalizes
    them; megatron's softmax *after* the top-k (moe_router_pre_softmax=False) is the same number.
    train_router: the load-balancing (auxiliary) loss of the HF config for a trained model; none for
    a frozen teacher or reference, whose router gets no gradient.
    """
    if not cfg.is_moe:
        return {}
    aux = train_router and cfg.router_aux_loss_coef > 0
    return dict(
        num_moe_experts=cfg.num_experts,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_topk=cfg.moe_topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not cfg.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if aux else "none",
        moe_aux_loss_coeff=cfg.router_aux_loss_coef if aux else 0.0,
        moe_token_dispatcher_type=moe_token_dispatcher(),
        moe_grouped_gemm=False,  # SequentialMLP: per-expert linear_fc1/fc2, the names weights.py maps
        expert_model_parallel_size=ep,
        # Experts split over TP exactly as the dense MLP (megatron's default expert TP = TP).
        expert_tensor_parallel_size=None,
    )


def transformer_config(
    cfg: HFModelConfig,
    tp: int = 1,
    pp: int = 1,
    dtype: str | torch.dtype = torch.float32,
    init_weights: bool = True,
    ep: int = 1,
    train_router: bool = True,
    **overrides,
) -> TransformerConfig:
    """The megatron TransformerConfig of an HF Qwen2/Llama/Qwen3/Qwen3-MoE decoder at TP=tp, PP=pp, EP=ep."""
    check_layout(cfg, tp, pp, ep)
    dt = torch_dtype(dtype)
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim,  # Qwen3: head_dim * heads != hidden_size
        qk_layernorm=cfg.qk_layernorm,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,  # SwiGLU: linear_fc1 holds [gate; up]
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dt,
        pipeline_dtype=dt,  # dtype of the activations sent between PP stages
        bf16=dt == torch.bfloat16,
        fp16=dt == torch.float16,
        # Weights are usually loaded right after building; skipping random init saves time at 7B.
        perform_initialization=init_weights,
        **moe_config(cfg, ep, train_router),
    )
    if not torch.cuda.is_available():
        kwargs.update(compat.cpu_config_overrides())
    kwargs.update(overrides)
    return compat.make_transformer_config(**kwargs)


def activation_memory_overrides(
    recompute: str = "none", recompute_num_layers: int = 1, sequence_parallel: bool = False
) -> dict:
    """TransformerConfig keys of a ModelConfig's memory options (recompute, sequence_parallel), for
    BuildOptions(config_overrides=...). megatron recomputes only in training mode, so a frozen model
    built with these runs its forward unchanged."""
    kwargs: dict = {"sequence_parallel": sequence_parallel}
    if recompute == "selective":
        kwargs.update(recompute_granularity="selective")  # megatron's default module list: core_attn
    elif recompute == "full":
        kwargs.update(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=recompute_num_layers
        )
    elif recompute != "none":
        raise ValueError(f"recompute={recompute!r}: choose none, selective or full")
    return kwargs


@dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """How build_gpt_model makes a model, beside its config and layout. The defaults: a trained float32 model
    with fresh weights, its stage's place in the pipeline taken from the process groups."""

    dtype: str | torch.dtype = torch.float32
    init_weights: bool = True
    """False: parameters left uninitialized (weights loaded next: faster, and no RNG drawn)."""
    train_router: bool = True
    """The MoE router's auxiliary loss is on (a trained student); False for a frozen teacher."""
    config_overrides: dict | None = None
    """TransformerConfig keys set over the derived ones (activation_memory_overrides)."""
    use_te: bool | None = None
    """Transformer Engine layers; None: when TE is importable and a GPU is present."""
    parallel_output: bool = True
    """The forward returns vocab-sharded logits [b, s, padded_vocab / tp]; the padding columns (index >=
    cfg.vocab_size) must be masked by whoever normalizes them (megaopd.models.vocab_padding; the scoring
    runner does)."""
    pre_process: bool | None = None
    """The stage holds the embedding; None: the first PP stage."""
    post_process: bool | None = None
    """The stage holds the output layer; None: the last PP stage."""


def build_gpt_model(
    cfg: HFModelConfig,
    layout: Layout,
    pg_collection: ProcessGroupCollection | None = None,
    options: BuildOptions | None = None,
) -> GPTModel:
    """Builds this rank's stage of the model: its PP stage's layers, its TP shard of each weight.

    layout.tp/pp must equal the sizes of pg_collection's tp/pp groups (or of parallel_state when None);
    layout.ep is the expert-parallel size of a MoE model (pg_collection.ep must have that size).
    options: BuildOptions() when None.
    """
    o = options if options is not None else BuildOptions()
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    pgs = compat.resolve_pg_collection(pg_collection)
    stage = StageInfo.of(pgs)
    if (stage.tp_size, stage.pp_size) != (tp, pp):
        raise ValueError(
            f"build_gpt_model with Layout(tp={tp}, pp={pp}) but the process groups have "
            f"tp={stage.tp_size}, pp={stage.pp_size}; pass the layout the groups were made for"
        )
    group_ep = pgs.ep.size() if getattr(pgs, "ep", None) is not None else 1
    if cfg.is_moe and group_ep != ep:
        raise ValueError(
            f"build_gpt_model with Layout(ep={ep}) but the process groups have ep={group_ep}; "
            "pass the layout the groups were made for"
        )
    config = transformer_config(cfg, tp, pp, o.dtype, o.init_weights, ep, o.train_router, **(o.config_overrides or {}))
    use_te = o.use_te
    if use_te is None:
        use_te = compat.use_transformer_engine_default()
    if cfg.is_moe:
        compat.patch_moe_router_without_te()
    spec = compat.decoder_block_spec(
        use_te, layers_per_stage(cfg, pp), qk_layernorm=cfg.qk_layernorm, num_experts=cfg.num_experts or None
    )
    llama3_factor = cfg.rope_scaling.factor if cfg.rope_scaling is not None else None
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(cfg.vocab_size, tp),
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=stage.pre_process if o.pre_process is None else o.pre_process,
        post_process=stage.post_process if o.post_process is None else o.post_process,
        parallel_output=o.parallel_output,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        pg_collection=pgs,
        **compat.rope_kwargs(cfg.rope_theta, llama3_factor),
    )
    if not o.init_weights:
        compat.mark_tensor_parallel_params(model)
    _cast_floating_params(model, config.params_dtype)
    if torch.cuda.is_available():
        # Without Transformer Engine, megatron's norms (torch.nn.RMSNorm) are made on the CPU while the
        # linears are made on the GPU: one model on one device, for every caller (trainer, tools, checks).
        model.cuda()
    return model


def apply_student_lora(model: GPTModel, cfg: HFModelConfig, lora: LoRAConfig, pgs: ProcessGroupCollection, seed: int):
    """LoRA adapters on this stage's targeted linears, the rest frozen (models/lora.py). Called after the base
    weights are loaded (the load maps base names only). Returns the adapted linears' names."""
    from megaopd.models.lora import apply_lora

    stage = StageInfo.of(pgs)
    offset = stage.pp_rank * layers_per_stage(cfg, stage.pp_size)
    return apply_lora(model, lora, pgs.tp, seed=seed, layer_offset=offset)


def _cast_floating_params(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter in the model's dtype. Without Transformer Engine megatron's norms
    (torch.nn.RMSNorm) ignore params_dtype and stay float32 in a bf16 model (Megatron-LM casts the whole
    model in its Float16Module; megaopd has no such wrapper). A float32 norm among bf16 weights broke the
    distributed optimizer's checkpoint on an H100 (its per-group parameter order assumes one dtype per
    model), kept torch's fused RMSNorm off, and differed from HF/SGLang bf16 models, whose norms are bf16.
    Buffers (RoPE frequencies) are left as they are."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
