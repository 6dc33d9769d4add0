"""models: the job config's section of one model (student, reference; a teacher extends it in
scoring/config.py) and the start-up checks of its layout against the model's config.json (no torch)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import List

MODEL_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a model (student, reference, teacher) or the embedded engine (rollout.engine_dtype) may have."""
RECOMPUTE_CHOICES = ("none", "selective", "full")
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "all")
"""What student.lora.targets may name: attention's fused q/k/v and output projections, the MLP's fused
gate/up and down projections (megatron's linear_qkv, linear_proj, linear_fc1, linear_fc2), or all four."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the student (models/lora.py): the base is frozen and only the adapters train."""

    enabled: bool = False
    """Off by default: every student parameter trains."""
    rank: int = 16
    """r: the adapters' inner size (A is r x in, B is out x r)."""
    alpha: float = 32.0
    """The update is (alpha / rank) B A; peft's lora_alpha."""
    targets: List[str] = field(default_factory=lambda: ["all"])
    """Which linears get adapters: qkv, proj, fc1, fc2, or all (MoE students: qkv and proj only)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (peft's lora_dropout)."""

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"student.lora.rank={self.rank}: the adapters' rank must be at least 1 (e.g. 16)")
        if not self.alpha > 0:
            raise ValueError(f"student.lora.alpha={self.alpha}: must be positive (peft's default is 2 * rank)")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ValueError(
                f"student.lora.targets={list(self.targets)}: choose from {', '.join(LORA_TARGETS)}"
                + (f" ({unknown[0]!r} is not one)" if unknown else "")
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"student.lora.dropout={self.dropout}: must be in [0, 1)")


@dataclass
class ModelConfig:
    """Where a model's weights are and how it is split over the job's ranks."""

    path: str = ""
    """An HF directory (config.json + safetensors) or a megaopd Megatron checkpoint directory; `~` and
    $VARIABLES are expanded (as in data paths), so a preset can name ~/.cache/megaopd/models/..."""
    tp: int = 1
    """Tensor-parallel size: must divide the attention heads and the KV (query) groups."""
    pp: int = 1
    """Pipeline-parallel size: must divide the number of layers."""
    ep: int = 1
    """Expert-parallel size (MoE models only, e.g. Qwen3-MoE): splits the routed experts over `ep` of the
    model's data-parallel ranks; must divide the number of experts and world_size / (tp * pp)."""
    dtype: str = "float32"
    """Parameter dtype: float32 (CPU default), bfloat16 or float16 (GPU)."""
    offload_between_uses: bool = False
    """GPU only, frozen models (teacher, reference): keep the weights in CPU memory and move them to the GPU
    only for their forward passes, leaving their GPU memory to the actor's activations (costs a host-to-device
    copy per use: 15 GB of bf16 7B weights at ~25 GB/s pinned is ~0.6 s). `megaopd plan` counts an
    offloaded model's weights as absent while the actor trains. Ignored for the student."""
    recompute: str = "none"
    """Activation recomputation while training (megatron TransformerConfig.recompute_granularity): none |
    selective (recompute the attention core: saves the b*a*s^2 scores of unfused attention; with flash
    attention it saves little) | full (keep only each layer's input and recompute the layer in backward:
    ~1/15 of the activations for ~30% more compute). Only the trained model uses it."""
    recompute_num_layers: int = 1
    """With recompute=full: layers per recomputed chunk (megatron recompute_method=uniform); 1 stores one
    input per layer, the least memory."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1 and Transformer Engine layers on GPU): the norms' and
    residuals' activations are split over the TP ranks along the sequence, so every activation is 1/tp
    per rank; the sequence length of a micro-batch must then be a multiple of tp."""

    def __post_init__(self):
        self.path = os.path.expandvars(os.path.expanduser(self.path))
        if self.tp < 1 or self.pp < 1 or self.ep < 1:
            raise ValueError(f"tp={self.tp}, pp={self.pp}, ep={self.ep}: parallel sizes must be at least 1")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose {', '.join(MODEL_DTYPES)}")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"recompute={self.recompute!r}: choose one of {', '.join(RECOMPUTE_CHOICES)}")
        if self.recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers={self.recompute_num_layers} must be at least 1")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "sequence_parallel=true needs tp > 1 (it splits activations over the TP ranks): "
                "set tp=2 or more, or sequence_parallel=false"
            )


@dataclass
class StudentConfig(ModelConfig):
    """The student's section: a model, and optionally LoRA adapters on it."""

    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self):
        super().__post_init__()
        if self.lora.enabled and self.sequence_parallel:
            raise ValueError(
                "student.lora with student.sequence_parallel=true is not supported (the adapters' input would be "
                "split along the sequence): set student.sequence_parallel=false"
            )


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a model that parallel layouts must divide, read from its config.json."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    architecture: str
    max_position_embeddings: int | None = None
    """Positions the model's RoPE was trained for (None when config.json does not say)."""
    num_experts: int = 0
    """Routed experts per MoE layer (Qwen3-MoE's num_experts); 0 for a dense model."""


def find_hf_config(path: str) -> str:
    """config.json of an HF directory, or the one a megaopd Megatron checkpoint keeps beside its shards (a
    path to the file itself is that file); FileNotFoundError naming the fix when there is none."""
    if os.path.isfile(path):
        return path
    for candidate in (os.path.join(path, "config.json"), os.path.join(path, "hf", "config.json")):
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"no config.json in {path!r}: point the path at an HF model directory or at a checkpoint "
        f"written by tools/convert_hf_to_megatron.py"
    )


def read_config_json(path: str) -> dict:
    """The config.json of find_hf_config(path) as a dict; ValueError naming the file when it is not a JSON
    object (a garbled or truncated copy). The one reader of config.json (hf_config.read_hf_config uses it)."""
    config = find_hf_config(path)
    try:
        with open(config, encoding="utf-8") as f:
            raw = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(
            f"{config} is not JSON ({type(e).__name__}: {e}): restore the model folder's config.json"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config} is not a JSON object: restore the model folder's config.json")
    return raw


def read_model_dims(path: str) -> ModelDims:
    hf = read_config_json(path)
    heads = int(hf["num_attention_heads"])
    return ModelDims(
        num_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        vocab_size=int(hf["vocab_size"]),
        architecture=(hf.get("architectures") or [hf.get("model_type", "?")])[0],
        max_position_embeddings=int(hf["max_position_embeddings"]) if hf.get("max_position_embeddings") else None,
        # Released configs say num_experts; transformers 5 writes num_local_experts on save.
        num_experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
    )


def check_context(role: str, path: str, dims: ModelDims, tokens: int, why: str) -> None:
    """Raises ValueError when a row of `tokens` tokens does not fit the model's positions."""
    if dims.max_position_embeddings is not None and tokens > dims.max_position_embeddings:
        raise ValueError(
            f"{role} {path} has max_position_embeddings={dims.max_position_embeddings} but rows reach {tokens} "
            f"tokens ({why}): extend its context explicitly in every folder the job loads it from "
            f"(python tools/extend_context.py --recipe luffy FOLDER ...; docs/cluster.md) or lower the lengths"
        )


def check_lora(lora: LoRAConfig, dims: ModelDims) -> None:
    """Raises ValueError (one line) when the student's adapters cannot go on this model."""
    if lora.enabled and dims.num_experts and ({"fc1", "fc2", "all"} & set(lora.targets)):
        raise ValueError(
            f"student.lora.targets={list(lora.targets)} on a MoE student ({dims.architecture}, {dims.num_experts} "
            "experts): LoRA on the expert linears is not supported; set student.lora.targets=[qkv,proj]"
        )


def check_role_layout(role: str, model: ModelConfig, world_size: int) -> ModelDims:
    """Raises ValueError naming the role, the size and the fix when the layout cannot be built."""
    if not model.path:
        raise ValueError(f"{role}.path is empty: set {role}.path=DIR (an HF directory or a megaopd checkpoint)")
    if not os.path.exists(model.path):
        raise ValueError(
            f"{role}.path={model.path!r} does not exist: fix the path or convert the model first "
            f"(tools/convert_hf_to_megatron.py)"
        )
    dims = read_model_dims(model.path)
    if dims.num_attention_heads % model.tp:
        raise ValueError(
            f"{role}.tp={model.tp} does not divide the {dims.num_attention_heads} attention heads "
            f"of {model.path}: choose a tp that divides {dims.num_attention_heads}"
        )
    if dims.num_query_groups % model.tp:
        raise ValueError(
            f"{role}.tp={model.tp} does not divide the {dims.num_query_groups} query (KV) groups "
            f"of {model.path}: choose a tp that divides {dims.num_query_groups}"
        )
    if dims.num_layers % model.pp:
        raise ValueError(
            f"{role}.pp={model.pp} does not divide the {dims.num_layers} layers of {model.path}: "
            f"choose a pp that divides {dims.num_layers}"
        )
    if world_size % (model.tp * model.pp):
        raise ValueError(
            f"run.world_size={world_size} is not a multiple of {role}.tp*{role}.pp="
            f"{model.tp * model.pp}: change the world size or the layout"
        )
    if model.ep > 1:
        if not dims.num_experts:
            raise ValueError(
                f"{role}.ep={model.ep} but {model.path} ({dims.architecture}) has no experts: "
                f"expert parallelism is for MoE models; set {role}.ep=1"
            )
        if dims.num_experts % model.ep:
            raise ValueError(
                f"{role}.ep={model.ep} does not divide the {dims.num_experts} experts of {model.path}: "
                f"choose an ep that divides {dims.num_experts}"
            )
        dp = world_size // (model.tp * model.pp)
        if dp % model.ep:
            raise ValueError(
                f"{role}.ep={model.ep} does not divide the data-parallel size {dp} (run.world_size="
                f"{world_size} / ({role}.tp*{role}.pp={model.tp * model.pp})): expert-parallel ranks "
                f"are data-parallel ranks; choose an ep that divides {dp}"
            )
    return dims
