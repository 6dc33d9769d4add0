"""Pure sizes of `megaopd plan` (config/plan.py): bytes of one model's weights, optimizer state, activations,
logits and engine cache from its HF config dimensions, per GPU or (cpu) per rank process. No file or device
is touched; the formulas and what they were checked against are in config/plan.py's docstring."""

from __future__ import annotations

from dataclasses import dataclass

from megaopd.models.hf_config import HFModelConfig, padded_vocab_size, params_per_rank
from megaopd.models.weights import hf_shapes, stage_rules

OPS_CHUNK_BYTES = 128 * 2**20  # megaopd.ops._common.DEFAULT_CHUNK_BYTES: one float32 chunk of logits
OPS_CHUNKS_LIVE = 3  # a chunk's logits in float32, its softmax and a gradient (or q's chunk)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RoleLayout:
    """One model of the job as the plan sees it."""

    name: str
    """student | reference | teacher."""
    hf: HFModelConfig
    tp: int
    pp: int
    dtype: str
    recompute: str = "none"
    sequence_parallel: bool = False
    offload: bool = False
    """Frozen models only: weights in CPU memory outside their forward passes."""
    ep: int = 1
    """Expert-parallel size (MoE models)."""
    cpu: bool = False
    """Runs on the CPU (plan.device=cpu): the layers keep what the CPU code paths keep (layer_saved_elements)."""
    lora_rank: int = 0
    """The student's LoRA rank (student.lora on; 0: off): its base is frozen and only the adapters train."""
    lora_linears: tuple[str, ...] = ()
    """The megatron linears that carry adapters (linear_qkv, linear_proj, linear_fc1, linear_fc2)."""
    weights_shared: bool = False
    """The reference read from the LoRA student itself with its adapters off (models/lora.BaseView): its
    forward's logits and hidden states are held as a loaded reference's are, but it has no weights of its own."""


@dataclass(frozen=True)
class EmbeddedEngineFootprint:
    """An embedded rollout engine on rank 0's GPU (rollout.engine=embedded), as the plan counts it."""

    weights: float
    """Its model's bytes in its dtype (the whole model: it does not shard)."""
    kv_cache: float
    """Its KV cache and decode buffers while generating: max_batch_size rows of the longest row."""
    colocated: bool
    """Weights offloaded once generation ends (rollout.colocated); else resident all along."""
    adapter_base: float = 0.0
    """A LoRA student's adapter syncs (rollout.lora_sync=adapter): the engine keeps a copy of every adapted
    weight's base in its dtype on the host, to merge each new adapter into (megaopd.engine.lora.AdapterMerge):
    resident memory of rank 0 on a CPU, host memory beside a GPU."""


def embedded_engine_footprint(
    hf: HFModelConfig, dtype: str, rows: int, seq: int, colocated: bool, adapted_linears=()
) -> EmbeddedEngineFootprint:
    """Weights, and the KV cache (2 x layers x kv_heads x head_dim per token) plus one float32 [rows, V] of
    decode logits, of an HF engine generating `rows` rows of up to `seq` tokens; with adapted_linears (a LoRA
    student's adapter syncs) the base copies of those linears' weights it keeps to merge adapters into."""
    e = DTYPE_BYTES[dtype]
    kv = 2 * hf.num_layers * hf.num_key_value_heads * hf.head_dim * e * rows * seq
    return EmbeddedEngineFootprint(
        params_per_rank(hf, 1, 1) * e,
        kv + 4.0 * rows * hf.vocab_size,
        colocated,
        adapted_base_params(hf, adapted_linears) * e,
    )


def adapted_base_params(hf: HFModelConfig, linears) -> int:
    """Parameters of the whole model's base weights that LoRA adapters on `linears` change (every layer's, the
    experts' left out as models/lora.py leaves them): what an engine merging adapters keeps a copy of."""
    shapes, total = hf_shapes(hf), 0
    for base in stage_rules(hf):
        if base.megatron.rsplit(".", 2)[-2] in linears and not base.expert and base.megatron.endswith(".weight"):
            total += sum(shapes[n][0] * shapes[n][1] for n in base.hf)
    return total


def adapter_params_per_rank(hf: HFModelConfig, linears, rank: int, tp: int, pp: int) -> int:
    """LoRA adapter parameters on one rank, as models/lora.py shards them: a column-parallel base (linear_qkv,
    linear_fc1) holds A [r, in] whole and B [out / tp, r]; a row-parallel one (linear_proj, linear_fc2) A
    [r, in / tp] and B [out, r] whole. Counted on megatron's linears, not peft's projections: a fused linear_qkv
    (q, k, v) or linear_fc1 (gate, up) has one A, which the peft export copies to each projection."""
    shapes, total = hf_shapes(hf), 0
    for base in stage_rules(hf):
        linear = base.megatron.rsplit(".", 2)[-2]
        if linear not in linears or base.expert or not base.megatron.endswith(".weight"):
            continue
        out, inp = sum(shapes[n][0] for n in base.hf), shapes[base.hf[0]][1]
        column = linear in ("linear_qkv", "linear_fc1")
        total += rank * inp + out // tp * rank if column else rank * inp // tp + out * rank
    return total // pp  # the layers split evenly over the stages (check_role_layout)


def adam_bytes_per_param(dtype: str) -> int:
    """fp32 m and v, plus an fp32 master copy when the model's params are half precision."""
    return 8 + (4 if DTYPE_BYTES[dtype] < 4 else 0)


def layer_saved_elements(hf: HFModelConfig, tp: int, sequence_parallel: bool, cpu: bool = False) -> dict[str, float]:
    """Elements one transformer layer keeps for its backward, per token, by part, as megatron's local layers
    (no Transformer Engine) keep them with a fused RMSNorm and flash attention; measured on CPU with
    saved-tensor hooks for the parts that run the same code there (tests/config/test_plan.py). TP-split
    parts are divided by tp; under sequence parallelism every part is (the linears keep their input shard).
    On the CPU the norms run a composite that also keeps its normalized output, and the packed attention
    (models/packed_attention.py causal_by_length) keeps its own output before gathering it back: 13,614
    elements a token measured at SmolLM2-135M's shape in float32, 13,504 counted."""
    h, f, d = hf.hidden_size, hf.intermediate_size, hf.head_dim
    q, k = hf.num_attention_heads * d, hf.num_key_value_heads * d
    seq_split = tp if sequence_parallel else 1  # the tensors kept whole over TP, split under SP
    parts = {
        "norms (each keeps its input)": 2 * h / seq_split,
        "attention linears' inputs (qkv: the norm's output; proj: the attention's output)": h / seq_split + q / tp,
        "q, k, v after RoPE (flash attention keeps them) and RoPE's cos/sin": (q + 2 * k) / tp + 4 * d,
        # fc1's input, its [t, 2f] output, then three [t, f]: the activation's output, the gated product (fc2's
        # input) and the gate half megatron's glu() makes contiguous.
        "MLP": h / seq_split + 5 * f / tp,
    }
    if cpu:
        parts["CPU: the norms' normalized outputs, the attention's batched output"] = 2 * h / seq_split + q / tp
    return parts


def layer_activation_bytes(
    role: RoleLayout, rows: int, seq: int, flash_attention: bool, attn_seq: int | None = None
) -> tuple[float, float]:
    """(bytes saved per layer for backward under role.recompute, bytes of one layer's full set) for one
    micro-batch of rows x seq tokens whose unfused attention scores span attn_seq keys per token (None: seq; a
    packed row: its longest sequence, attention stays within each)."""
    hf, tp, sequence_parallel = role.hf, role.tp, role.sequence_parallel
    e = DTYPE_BYTES[role.dtype]
    tokens = rows * seq
    whole = e * tokens * sum(layer_saved_elements(hf, tp, sequence_parallel, role.cpu).values())
    keys = seq if attn_seq is None else min(attn_seq, seq)
    scores = 0.0 if flash_attention else 2 * e * rows * (hf.num_attention_heads / tp) * seq * keys
    full_layer = whole + scores
    if role.recompute == "full":
        return e * tokens * hf.hidden_size / (tp if sequence_parallel else 1), full_layer
    if role.recompute == "selective":
        return whole, full_layer
    return full_layer, full_layer


def activation_bytes(
    role: RoleLayout, rows: int, seq: int, flash_attention: bool, attn_seq: int | None = None
) -> float:
    """Activations saved by the trained model for one optimizer micro-batch (all in-flight micro-batches)."""
    saved, one_layer = layer_activation_bytes(role, rows, seq, flash_attention, attn_seq)
    layers = role.hf.num_layers // role.pp
    in_flight = role.pp  # 1F1B: the first stage holds pp micro-batches before its first backward
    total = saved * layers * in_flight
    if role.recompute == "full":
        total += one_layer  # the layer being recomputed in backward holds its full set for a moment
    return total


def logits_bytes(role: RoleLayout, rows: int, seq: int) -> float:
    """The output layer's vocab-parallel logits of one micro-batch: [rows*seq, V/tp] in the model's dtype."""
    vocab_shard = padded_vocab_size(role.hf.vocab_size, role.tp) // role.tp
    return DTYPE_BYTES[role.dtype] * rows * seq * vocab_shard


def hidden_bytes(role: RoleLayout, tokens: int) -> float:
    """The output layer's input of `tokens` tokens, [tokens, h] in the model's dtype (whole on every TP rank)."""
    return DTYPE_BYTES[role.dtype] * tokens * role.hf.hidden_size


def fused_weight_grad_bytes(role: RoleLayout) -> float:
    """The fused output layer's gradient of its weight shard: a float32 [V/t, h] accumulator and one product
    in the model's dtype (megaopd.ops.head)."""
    vocab_shard = padded_vocab_size(role.hf.vocab_size, role.tp) // role.tp
    return (4.0 + DTYPE_BYTES[role.dtype]) * vocab_shard * role.hf.hidden_size


def ops_chunk_bytes(role: RoleLayout, rows: int, seq: int) -> float:
    vocab_shard = padded_vocab_size(role.hf.vocab_size, role.tp) // role.tp
    return min(OPS_CHUNKS_LIVE * OPS_CHUNK_BYTES, OPS_CHUNKS_LIVE * 4.0 * rows * seq * vocab_shard)


def forward_layer_bytes(
    role: RoleLayout, rows: int, seq: int, flash_attention: bool, attn_seq: int | None = None
) -> float:
    """Working set of a forward-only pass: one layer's tensors at a time (nothing is saved, whatever the
    recompute setting: the full set is the same)."""
    return layer_activation_bytes(role, rows, seq, flash_attention, attn_seq)[1]
