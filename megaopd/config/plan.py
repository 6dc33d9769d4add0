"""`megaopd plan CONFIG [key=value ...]`: per-GPU memory of a job's configured layout, before any GPU hour.

    megaopd plan examples/paper/stable_opd_7b.yaml student.path=$MODELS/Qwen2.5-Math-7B ...
    exit 0: the peak fits plan.gpu_memory_gb; exit 1: it does not (the message names the biggest items
    and what to change)

The model is counted in bytes per GPU of the largest pipeline stage, from the HF config.json dimensions
(h hidden, a heads, k = kv_heads * head_dim, f FFN width, L layers, V vocabulary padded as megatron pads
it), for three phases of a step:

    generate  colocated engines hold their memory fraction; the trainer keeps its weights, gradient
              buffer and optimizer state (plus the frozen models that are not offloaded)
    score     teacher and actor forward passes of one micro-batch (log q, log pi_old), one after the other
              (the larger counts); engines released
    train     actor forward+backward of one micro-batch, with the reference in lockstep

A micro-batch is what one forward holds: with trainer.pack_sequences=true (the default) one packed row of
trainer.max_tokens_per_micro_batch tokens (or one longer sequence, or one GRPO group kept whole; attention
only within each sequence: its scores are bounded by tokens x the longest sequence), otherwise
trainer.micro_batch_size padded rows of the longest sequence.

Per item (b rows of S tokens per micro-batch, e bytes per element of the model's dtype, t = tp, d = DP):
- weights: params_rank * e; gradients: params_rank * 4 (megatron's DDP accumulates and reduces in fp32,
  trainer/optim.py grad_reduce_in_fp32=True);
- Adam: m and v in fp32 (8 bytes/param) plus fp32 master weights when the params are bf16/fp16 (4 more),
  divided by d with the distributed optimizer (megatron shards only these; weights and gradients stay whole);
- activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", redone for SwiGLU, GQA, RMSNorm and no dropout): the tensors a layer saves for backward are
  the two norm inputs and outputs (4h, whole on every TP rank unless sequence parallel), q, k, v and the
  attention output (2h + 2k) and the MLP's gate, up and activation (3f), all split over t:
      none / selective:  e*b*S*(4h + (2h + 2k + 3f)/t)       with SP: e*b*S*(6h + 2k + 3f)/t
  plus, for unfused attention (no flash / Transformer Engine; the CPU path), the scores and
  probabilities 2*e*b*(a/t)*S^2 unless recompute=selective drops them; recompute=full keeps only each
  layer's input, e*b*S*h (/t with SP), plus one layer's worth while it is recomputed. Pipeline stages hold
  up to pp micro-batches in flight (1F1B);
- logits (L = [b*S, V/t] in e bytes, the output layer's own output): the training step holds 2L, plus the
  ops' float32 chunks (megaopd.ops upcasts 128 MiB of tokens at a time): the student's logits and the frozen
  reference's (lockstep, for the exact KL; kept apart from the student's, never concatenated), whose memory
  the fused backward then fills with the student's gradient (without a reference: the logits and their
  gradient). Neither the scoring passes nor the loss make a float32 copy of the logits (benchmarks/memory.py
  measures it); padded rows (b > 1, pack_sequences=false) add a shifted contiguous copy of each model's
  logits (the loss reads logits[:, :-1]): 4L with the reference. A scoring pass holds L and the chunks (padded rows: at least 2L for a moment, megatron's [S, b] -> [b, S] copy of its output).
  With the fused output layer (trainer.logits_chunk_tokens = c > 0, megaopd.ops.head, the default) no L is
  made: per model a chunk's logits Lc = [c, V/t] in e bytes, in training the student's chunk gradient
  (in the reference chunk's memory, as above) and the ops' float32 chunks of c tokens, the output weight's
  gradient accumulated in float32 (4 [V/t, h]) plus one e-byte product, and the hidden states the layer
  would have read: [b*S, h] per model, a second copy of the student's (megatron's [s, b] -> [b, s]) and, in
  backward, their gradient;
- what nvidia-smi also shows (the GPU check compares against it): each process's CUDA context
  (plan.cuda_context_gb), the caching allocator's freed-but-reserved blocks (plan.allocator_reserve, a
  fraction of each phase's allocated bytes), and an embedded rollout engine on rank 0's GPU
  (rollout.engine=embedded): its weights in its dtype (rollout.engine_dtype) the whole run unless colocated (then
  offloaded after generating), and its KV cache while it generates (max_batch_size rows of the longest
  prompt + max_new_tokens).

The numbers are estimates to size a layout, not a measurement: NCCL buffers and anything else not itemized
are one flat `plan.reserved_gb` margin. Checked against hand-computed sizes of Qwen2.5-7B at
TP=2 and a psutil measurement on CPU (tests/config/test_plan.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megaopd.config.step_time import StepTimeConfig
from megaopd.engine.config import CUDA_SYNC_EVERY, cache_positions
from megaopd.losses import build_loss_from
from megaopd.models.config import find_hf_config
from megaopd.models.hf_config import HFModelConfig, padded_vocab_size, params_per_rank, read_hf_config

if TYPE_CHECKING:  # the schema composes PlanConfig from here
    from megaopd.config.schema import MegaOPDConfig

GB = 1e9
OPS_CHUNK_BYTES = 128 * 2**20  # megaopd.ops._common.DEFAULT_CHUNK_BYTES: one float32 chunk of logits
OPS_CHUNKS_LIVE = 3            # a chunk's logits in float32, its softmax and a gradient (or q's chunk)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class PlanConfig:
    """Inputs of `megaopd plan` (per-GPU memory of the configured layout) that the rest of the config
    does not say: the GPU, the engines' share, what the model leaves out."""

    gpu_memory_gb: float = 141.0
    """Memory of one GPU in GB (1e9 bytes): 141 for an H200, 80 for an H100."""
    engine_memory_fraction: float = 0.5
    """Colocated engines (rollout.colocated): the share of GPU memory they hold while generating (SGLang
    --mem-fraction-static; slurm/common.sh ENGINE_MEM_FRACTION, 0.5 colocated)."""
    engine_released_gb: float = 3.0
    """What a colocated engine keeps after releasing its weights and KV cache (CUDA context, CUDA graphs)."""
    reserved_gb: float = 5.0
    """A margin for what is not itemized (NCCL communicator buffers at many ranks, cuDNN/cuBLAS autotuning
    workspaces), as one flat amount on top of the items."""
    cuda_context_gb: float = 0.6
    """One process's CUDA context with torch's kernels and the cuBLAS workspace (about 0.5-0.6 GB on an H100
    with CUDA 12-13, not measured here; nvidia-smi counts it, torch's allocator does not)."""
    allocator_reserve: float = 0.1
    """torch's caching allocator keeps freed blocks reserved for reuse (nvidia-smi counts them): this fraction
    of each phase's allocated bytes is added (fragmentation between the phases' differently sized tensors)."""
    attention: str = "flash"
    """flash: fused attention (Transformer Engine / flash-attention on GPU) saves no S x S scores; unfused:
    megatron's local attention (CPU, or no TE) saves scores and probabilities."""
    max_tokens: int = 0
    """Tokens per row to plan for; 0: data.max_prompt_len + the longer of rollout.max_new_tokens and (for
    losses that train on golden solutions) data.max_golden_len."""
    step_time: StepTimeConfig = field(default_factory=StepTimeConfig)
    """Rates of `megaopd plan --step-time` (megaopd/config/step_time.py)."""

    def __post_init__(self):
        if self.gpu_memory_gb <= 0:
            raise ValueError(f"plan.gpu_memory_gb={self.gpu_memory_gb} must be positive (141 for an H200)")
        if not 0 <= self.engine_memory_fraction < 1:
            raise ValueError(f"plan.engine_memory_fraction={self.engine_memory_fraction} must be in [0, 1)")
        if self.attention not in ("flash", "unfused"):
            raise ValueError(f"plan.attention={self.attention!r}: choose flash or unfused")
        if self.max_tokens < 0:
            raise ValueError(f"plan.max_tokens={self.max_tokens} must be >= 0 (0: from data and rollout)")
        if self.cuda_context_gb < 0 or not 0 <= self.allocator_reserve < 1:
            raise ValueError(f"plan.cuda_context_gb={self.cuda_context_gb} must be >= 0 and plan.allocator_reserve="
                             f"{self.allocator_reserve} in [0, 1)")


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


@dataclass(frozen=True)
class EmbeddedEngineFootprint:
    """An embedded rollout engine on rank 0's GPU (rollout.engine=embedded), as the plan counts it."""

    weights: float
    """Its model's bytes in its dtype (the whole model: it does not shard)."""
    kv_cache: float
    """Its KV cache and decode buffers while generating: max_batch_size rows of the longest row."""
    colocated: bool
    """Weights offloaded once generation ends (rollout.colocated); else resident all along."""


def embedded_engine_footprint(hf: HFModelConfig, dtype: str, rows: int, seq: int,
                              colocated: bool) -> EmbeddedEngineFootprint:
    """Weights, and the KV cache (2 x layers x kv_heads x head_dim per token) plus one float32 [rows, V] of
    decode logits, of an HF engine generating `rows` rows of up to `seq` tokens."""
    e = DTYPE_BYTES[dtype]
    kv = 2 * hf.num_layers * hf.num_key_value_heads * hf.head_dim * e * rows * seq
    return EmbeddedEngineFootprint(params_per_rank(hf, 1, 1) * e, kv + 4.0 * rows * hf.vocab_size, colocated)


@dataclass(frozen=True)
class Item:
    """One line of the table: bytes per GPU in each phase (0 where the item is not resident)."""

    name: str
    generate: float
    score: float
    train: float
    hint: str = ""
    """What to change to shrink it (named in the error when this item is among the biggest)."""

    def peak(self) -> float:
        return max(self.generate, self.score, self.train)


@dataclass
class Plan:
    items: list[Item]
    gpu_bytes: float
    phases: tuple[str, ...] = ("generate", "score", "train")
    notes: list[str] = field(default_factory=list)
    allocator_reserve: float = 0.0
    """Fraction of each phase's itemized bytes the caching allocator keeps reserved (PlanConfig)."""

    def allocated(self, phase: str) -> float:
        return sum(getattr(i, phase) for i in self.items)

    def total(self, phase: str) -> float:
        """The phase's bytes as nvidia-smi would show them: the items plus the allocator's reserve."""
        return self.allocated(phase) * (1.0 + self.allocator_reserve)

    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    def fits(self) -> bool:
        return max(self.total(p) for p in self.phases) <= self.gpu_bytes


# ------------------------------------------------------------------------------------------ pure sizes
def adam_bytes_per_param(dtype: str) -> int:
    """fp32 m and v, plus an fp32 master copy when the model's params are half precision."""
    return 8 + (4 if DTYPE_BYTES[dtype] < 4 else 0)


def layer_saved_elements(hf: HFModelConfig, tp: int, sequence_parallel: bool) -> dict[str, float]:
    """Elements one transformer layer keeps for its backward, per token, by part, as megatron's local layers
    (no Transformer Engine) keep them with a fused RMSNorm and flash attention; measured on CPU with
    saved-tensor hooks for the parts that run the same code there (tests/config/test_plan.py). TP-split
    parts are divided by tp; under sequence parallelism every part is (the linears keep their input shard)."""
    h, f, d = hf.hidden_size, hf.intermediate_size, hf.head_dim
    q, k = hf.num_attention_heads * d, hf.num_key_value_heads * d
    seq_split = tp if sequence_parallel else 1  # the tensors kept whole over TP, split under SP
    return {
        "norms (each keeps its input)": 2 * h / seq_split,
        "attention linears' inputs (qkv: the norm's output; proj: the attention's output)": h / seq_split + q / tp,
        "q, k, v after RoPE (flash attention keeps them) and RoPE's cos/sin": (q + 2 * k) / tp + 4 * d,
        # fc1's input, its [t, 2f] output, then three [t, f]: the activation's output, the gated product (fc2's
        # input) and the gate half megatron's glu() makes contiguous.
        "MLP": h / seq_split + 5 * f / tp,
    }


def layer_activation_bytes(hf: HFModelConfig, rows: int, seq: int, tp: int, dtype: str, recompute: str,
                           sequence_parallel: bool, flash_attention: bool,
                           attn_seq: int | None = None) -> tuple[float, float]:
    """(bytes saved per layer for backward, bytes of one layer's full set) for one micro-batch of rows x seq
    tokens whose unfused attention scores span attn_seq keys per token (None: seq; a packed row: its longest
    sequence, attention stays within each)."""
    e = DTYPE_BYTES[dtype]
    tokens = rows * seq
    whole = e * tokens * sum(layer_saved_elements(hf, tp, sequence_parallel).values())
    keys = seq if attn_seq is None else min(attn_seq, seq)
    scores = 0.0 if flash_attention else 2 * e * rows * (hf.num_attention_heads / tp) * seq * keys
    full_layer = whole + scores
    if recompute == "full":
        return e * tokens * hf.hidden_size / (tp if sequence_parallel else 1), full_layer
    if recompute == "selective":
        return whole, full_layer
    return full_layer, full_layer


def activation_bytes(role: RoleLayout, rows: int, seq: int, flash_attention: bool,
                     attn_seq: int | None = None) -> float:
    """Activations saved by the trained model for one optimizer micro-batch (all in-flight micro-batches)."""
    saved, one_layer = layer_activation_bytes(role.hf, rows, seq, role.tp, role.dtype, role.recompute,
                                              role.sequence_parallel, flash_attention, attn_seq)
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


def forward_layer_bytes(role: RoleLayout, rows: int, seq: int, flash_attention: bool,
                        attn_seq: int | None = None) -> float:
    """Working set of a forward-only pass: one layer's tensors at a time (nothing is saved)."""
    return layer_activation_bytes(role.hf, rows, seq, role.tp, role.dtype, "none", role.sequence_parallel,
                                  flash_attention, attn_seq)[1]


def packed_micro_batch_tokens(max_tokens: int, seq_len: int, group_size: int = 1) -> int:
    """Tokens of the largest packed micro-batch: the budget, or one packing unit longer than it (a sequence
    of seq_len tokens, or a GRPO group of group_size sequences, which packing keeps whole)."""
    return max(max_tokens, seq_len * group_size)


# ------------------------------------------------------------------------------------------- the plan
def build_plan(student: RoleLayout, reference: RoleLayout | None, teacher: RoleLayout | None, *, world_size: int,
               micro_batch_rows: int, seq_len: int, use_distributed_optimizer: bool, colocated: bool,
               gpu_memory_gb: float, engine_memory_fraction: float, engine_released_gb: float,
               reserved_gb: float, flash_attention: bool, packed_tokens: int = 0, logits_chunk_tokens: int = 0,
               cuda_context_gb: float = 0.0, allocator_reserve: float = 0.0,
               embedded_engine: EmbeddedEngineFootprint | None = None) -> Plan:
    """Bytes per GPU of every item in each phase; pure (no file or device is touched).

    packed_tokens > 0 (trainer.pack_sequences=true): every micro-batch is one packed row of that many tokens
    (packed_micro_batch_tokens), whose sequences are at most seq_len long; micro_batch_rows is then unused.
    0: micro_batch_rows padded rows of seq_len tokens. logits_chunk_tokens > 0: the fused output layer
    (trainer.logits_chunk_tokens): logits of that many tokens at a time instead of the micro-batch's."""
    dp = max(1, world_size // (student.tp * student.pp))
    p_actor = params_per_rank(student.hf, student.tp, student.pp, student.ep)
    e = DTYPE_BYTES[student.dtype]
    adam = adam_bytes_per_param(student.dtype) * p_actor / (dp if use_distributed_optimizer else 1)
    packed = packed_tokens > 0
    b, s = (1, packed_tokens) if packed else (micro_batch_rows, seq_len)
    attn = seq_len if packed else None  # a packed row attends within each sequence only
    # What to lower when a micro-batch's activations or logits do not fit.
    smaller = ("lower trainer.max_tokens_per_micro_batch" if packed else "lower trainer.micro_batch_size")
    shape = f"{s} tokens packed" if packed else f"{b} x {s} tokens"
    items = []

    def static(name, nbytes, hint=""):
        items.append(Item(name, nbytes, nbytes, nbytes, hint))

    static("student weights", p_actor * e, "raise student.tp (or student.pp)")
    static("student gradients (fp32)", p_actor * 4.0, "raise student.tp (or student.pp)")
    opt_hint = ("set optimizer.use_distributed_optimizer=true (shards Adam over the data-parallel ranks)"
                if not use_distributed_optimizer else "add data-parallel ranks (more GPUs) or raise student.tp")
    static(f"Adam states{' (sharded /' + str(dp) + ')' if use_distributed_optimizer else ''}", adam, opt_hint)
    act_hint = ("set student.recompute=full" if student.recompute != "full" else
                smaller if packed or b > 1 else "raise student.tp with student.sequence_parallel=true")
    if student.recompute != "full" and not student.sequence_parallel and student.tp > 1:
        act_hint += " or student.sequence_parallel=true"
    items.append(Item(f"student activations ({shape}, recompute={student.recompute}"
                      f"{', SP' if student.sequence_parallel else ''})", 0, 0,
                      activation_bytes(student, b, s, flash_attention, attn),
                      act_hint if act_hint == smaller else f"{act_hint}, or {smaller}"))
    if logits_chunk_tokens:
        _fused_logits_items(items, student, reference, teacher, b, s, min(logits_chunk_tokens, b * s), smaller,
                            flash_attention, attn)
    else:
        _whole_logits_items(items, student, reference, teacher, b, s, packed, shape, smaller, flash_attention, attn)
    if reference is not None:
        w = params_per_rank(reference.hf, reference.tp, reference.pp, reference.ep) * DTYPE_BYTES[reference.dtype]
        # In lockstep with the actor: on the GPU whenever the actor trains; offload frees it while engines
        # generate and while the teacher scores.
        off = 0.0 if reference.offload else w
        items.append(Item("reference weights" + (" (offloaded)" if reference.offload else ""), off, off, w,
                          "set reference.offload_between_uses=true"))
    if teacher is not None:
        w = params_per_rank(teacher.hf, teacher.tp, teacher.pp, teacher.ep) * DTYPE_BYTES[teacher.dtype]
        off = 0.0 if teacher.offload else w
        items.append(Item("teacher weights" + (" (offloaded)" if teacher.offload else ""), off, w, off,
                          "set teacher.offload_between_uses=true or raise teacher.tp"))
    if colocated:
        share = engine_memory_fraction * gpu_memory_gb * GB
        rest = engine_released_gb * GB
        items.append(Item(f"colocated engine (mem fraction {engine_memory_fraction:g}; released: "
                          f"{engine_released_gb:g} GB)", share, rest, rest,
                          "lower the engines' memory fraction (ENGINE_MEM_FRACTION, plan.engine_memory_fraction) "
                          "or give engines their own nodes (ENGINE_NODES)"))
    if embedded_engine is not None:
        eng = embedded_engine
        kept = 0.0 if eng.colocated else eng.weights
        items.append(Item(f"embedded engine on rank 0 (weights{'; offloaded after generating' if eng.colocated else ''}"
                          f"; KV cache while generating)", eng.weights + eng.kv_cache, kept, kept,
                          "set rollout.colocated=true (offloads its weights while training), lower "
                          "rollout.max_batch_size, or serve rollouts (rollout.engine=remote)"))
    if cuda_context_gb:
        static("CUDA context (one process)", cuda_context_gb * GB)
    static("reserved (NCCL, not itemized)", reserved_gb * GB)
    head = "fused output layer, " + f"{logits_chunk_tokens} tokens a chunk" if logits_chunk_tokens else "whole logits"
    notes = [f"per GPU at student tp={student.tp} pp={student.pp} dp={dp}, {p_actor / 1e9:.3f}B student params "
             f"per rank, micro-batch {shape}, {'flash' if flash_attention else 'unfused'} attention, {head}"
             + (f"; totals include the allocator's reserve (+{allocator_reserve:.0%})" if allocator_reserve else "")]
    return Plan(items, gpu_memory_gb * GB, notes=notes, allocator_reserve=allocator_reserve)


def _fused_logits_items(items, student, reference, teacher, b, s, chunk, smaller, flash_attention, attn) -> None:
    """The logits items of the fused output layer: chunks of `chunk` tokens, the hidden states, the weight's
    float32 gradient (module docstring)."""
    tokens = b * s
    lc = logits_bytes(student, 1, chunk)
    grad_in_reference = reference is not None and reference.dtype == student.dtype
    hid = hidden_bytes(student, tokens)
    # Its output, megatron's [s, b] -> [b, s] copy of it, and its gradient in backward.
    train = ((1 if grad_in_reference else 2) * lc + ops_chunk_bytes(student, 1, chunk)
             + fused_weight_grad_bytes(student) + 3 * hid)
    items.append(Item(f"student logits (fused: {chunk} tokens a chunk; weight grad fp32; hidden states)", 0, 0,
                      train, f"lower trainer.logits_chunk_tokens or {smaller}"))
    if reference is not None:
        items.append(Item("reference logits (fused: its chunk and hidden states)", 0, 0,
                          logits_bytes(reference, 1, chunk) + hidden_bytes(reference, tokens),
                          "lower trainer.logits_chunk_tokens"))
    scoring = [(lc + ops_chunk_bytes(student, 1, chunk) + 2 * hid
                + forward_layer_bytes(student, b, s, flash_attention, attn), "student")]
    if teacher is not None:
        scoring.append((logits_bytes(teacher, 1, chunk) + ops_chunk_bytes(teacher, 1, chunk)
                        + 2 * hidden_bytes(teacher, tokens) + forward_layer_bytes(teacher, b, s, flash_attention, attn),
                        "teacher"))
    score_bytes, scorer = max(scoring)
    items.append(Item(f"scoring pass ({scorer}'s, the larger: a logits chunk + one layer)", 0, score_bytes, 0,
                      f"{smaller} or raise {scorer}.tp"))


def _whole_logits_items(items, student, reference, teacher, b, s, packed, shape, smaller, flash_attention,
                        attn) -> None:
    """The logits items when the model's output layer makes the micro-batch's whole logits (module docstring)."""
    lg = logits_bytes(student, b, s)
    # Training with the reference in lockstep: the fused backward writes the student's gradient into the
    # reference logits' memory (ops.vocab_parallel_logprobs_kl overwrite_q), so the gradient is no new buffer.
    grad_in_reference = reference is not None and reference.dtype == student.dtype
    # Scoring: the logits (padded rows: megatron's [S, b] -> [b, S] copy of them too) and the ops' chunks.
    score_logits = lg + ops_chunk_bytes(student, b, s) if packed or b == 1 else max(2 * lg, lg + ops_chunk_bytes(student, b, s))
    # The scoring passes run one after the other (actor's log pi_old, then the teacher's): the larger counts.
    scoring = [(score_logits + forward_layer_bytes(student, b, s, flash_attention, attn), "student")]
    # Padded rows (b > 1): logits[:, :-1] of several rows is not contiguous, and the loss's ops each take a
    # contiguous copy of it while megatron still holds the output: one more L (benchmarks/memory.py: 4.5L
    # with the reference, against 2.4L packed).
    student_train = (1 if grad_in_reference else 2) * lg + (lg if not packed and b > 1 else 0)
    items.append(Item(f"student logits ({shape}{'' if grad_in_reference else '; + grad in backward'}"
                      f"{'; + shifted copy' if not packed and b > 1 else ''})", 0, 0,
                      student_train + ops_chunk_bytes(student, b, s), f"{smaller} or raise student.tp"))
    if reference is not None:
        ref_lg = logits_bytes(reference, b, s) * (2 if not packed and b > 1 else 1)  # padded: + its shifted copy
        items.append(Item("reference logits (lockstep KL" + ("; then the student's grad)" if grad_in_reference else ")"),
                          0, 0, ref_lg, smaller))
    if teacher is not None:
        t_lg = logits_bytes(teacher, b, s)
        scoring.append((max(t_lg if packed or b == 1 else 2 * t_lg, t_lg + ops_chunk_bytes(teacher, b, s))
                        + forward_layer_bytes(teacher, b, s, flash_attention, attn), "teacher"))
    score_bytes, scorer = max(scoring)
    items.append(Item(f"scoring pass ({scorer}'s, the larger: logits + one layer)", 0, score_bytes, 0,
                      f"{smaller} or raise {scorer}.tp"))


def format_plan(plan: Plan) -> str:
    width = max(len(i.name) for i in plan.items) + 2
    head = f"{'item':<{width}}" + "".join(f"{p:>10}" for p in plan.phases)
    lines = [*plan.notes, head, "-" * len(head)]
    for i in plan.items:
        lines.append(f"{i.name:<{width}}" + "".join(f"{getattr(i, p) / GB:>10.2f}" for p in plan.phases))
    lines.append("-" * len(head))
    lines.append(f"{'total (GB)':<{width}}" + "".join(f"{plan.total(p) / GB:>10.2f}" for p in plan.phases))
    lines.append(f"{'GPU memory (GB)':<{width}}" + f"{plan.gpu_bytes / GB:>10.2f}" * len(plan.phases))
    return "\n".join(lines)


def explain_overflow(plan: Plan, top: int = 3) -> str:
    """One message: the phase that overflows, by how much, its biggest items and what to change."""
    phase = plan.peak_phase()
    over = plan.total(phase) - plan.gpu_bytes
    biggest = sorted(plan.items, key=lambda i: getattr(i, phase), reverse=True)[:top]
    parts = [f"{i.name} {getattr(i, phase) / GB:.1f} GB ({i.hint})" for i in biggest if i.hint]
    return (f"does not fit: the {phase} phase needs {plan.total(phase) / GB:.1f} GB per GPU, "
            f"{over / GB:.1f} GB more than plan.gpu_memory_gb={plan.gpu_bytes / GB:g}; biggest: " + "; ".join(parts))


def plan_for(cfg: MegaOPDConfig) -> Plan:
    """The Plan of a loaded config (reads the models' config.json files)."""
    needs = build_loss_from(cfg.loss).needs

    def role(name, section, path=None):
        hf = read_hf_config(find_hf_config(path or section.path))
        return RoleLayout(name, hf, section.tp, section.pp, section.dtype, section.recompute,
                          section.sequence_parallel, section.offload_between_uses and name != "student", section.ep)

    student = role("student", cfg.student)
    reference = role("reference", cfg.reference, cfg.reference.path or cfg.student.path) if needs.reference else None
    # The in-job teacher's weights share the GPUs (a served one's do not). build_plan counts one teacher: with
    # several in-job teachers, the first.
    in_job = [t for t in cfg.teachers if t.engine == "megatron"]
    teacher = role("teacher", in_job[0]) if in_job else None
    seq = cfg.plan.max_tokens or cfg.data.max_prompt_len + max(
        cfg.rollout.max_new_tokens if needs.on_policy else 0, cfg.data.max_golden_len if needs.golden else 0)
    # Packed micro-batches (the default) hold max_tokens_per_micro_batch tokens whatever micro_batch_size is;
    # a GRPO group is packed whole (rewards), so a group longer than the budget is one micro-batch.
    group = cfg.trainer.samples_per_prompt if needs.rewards else 1
    packed = packed_micro_batch_tokens(cfg.trainer.max_tokens_per_micro_batch, seq, group) \
        if cfg.trainer.pack_sequences else 0
    engine = None
    if cfg.rollout.engine == "embedded" and (needs.on_policy or cfg.validation.path):
        # The embedded engine generates on rank 0's GPU with the student's architecture (rollout/build.py),
        # its KV cache sized to the longest generated row as the engine rounds it on CUDA (megaopd.engine).
        positions = cache_positions(cfg.generated_row_tokens(), CUDA_SYNC_EVERY)
        engine = embedded_engine_footprint(student.hf, cfg.embedded_engine_dtype(), cfg.rollout.max_batch_size,
                                           positions, cfg.rollout.colocated)
    return build_plan(student, reference, teacher, world_size=cfg.run.world_size,
                      micro_batch_rows=cfg.trainer.micro_batch_size, seq_len=seq, packed_tokens=packed,
                      use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
                      colocated=cfg.rollout.colocated and cfg.rollout.engine == "remote",
                      gpu_memory_gb=cfg.plan.gpu_memory_gb, engine_memory_fraction=cfg.plan.engine_memory_fraction,
                      engine_released_gb=cfg.plan.engine_released_gb, reserved_gb=cfg.plan.reserved_gb,
                      flash_attention=cfg.plan.attention == "flash", logits_chunk_tokens=cfg.trainer.logits_chunk_tokens,
                      cuda_context_gb=cfg.plan.cuda_context_gb, allocator_reserve=cfg.plan.allocator_reserve,
                      embedded_engine=engine)
