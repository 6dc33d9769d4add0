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
  divided by d with the distributed optimizer (megatron shards only these; weights and gradients stay whole).
  torch's Adam makes them at the first optimizer step, after the first backward: the plan's peak is a run's
  from step 2 on, and step 1 peaks about this item lower (benchmarks/README.md, "Plan vs measured");
- a LoRA student (student.lora): weights = the frozen base + the adapters, gradients and Adam's state the
  adapters' alone; when its base is the reference (MegaOPDConfig.reference_is_the_base) no reference weights,
  but the reference's lockstep forward (the base with its adapters off) keeps its logits items (measured
  item by item on CPU: benchmarks/plan_vs_measured.py --parts, tests/config/test_lora_plan.py). Its
  activations are counted as full training's: a LoRA forward kept less for backward than a full one on CPU
  (80 vs 94 MB, the tiny student at TP=1, 2048 tokens, torch's profiler);
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
  logits (the loss reads logits[:, :-1]): 4L with the reference. A scoring pass holds L and the chunks (padded rows:
  at least 2L for a moment, megatron's [S, b] -> [b, S] copy of its output).
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
  prompt + max_new_tokens). With a LoRA student's adapter syncs (rollout.lora_sync=adapter) the engine also keeps
  the base of every adapted weight, to merge each new adapter into: host memory (counted on device=cpu only,
  where it is rank 0's resident memory; about the whole model again when every linear has adapters).

The numbers are estimates to size a layout, not a measurement: NCCL buffers and anything else not itemized
are one flat `plan.reserved_gb` margin. Checked against hand-computed sizes of Qwen2.5-7B at
TP=2 and a psutil measurement on CPU (tests/config/test_plan.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from megaopd.config.plan_shape import MicroBatchShape, StepRows, job_shapes
from megaopd.config.plan_sizes import (
    DTYPE_BYTES,
    EmbeddedEngineFootprint,
    RoleLayout,
    activation_bytes,
    adam_bytes_per_param,
    adapter_params_per_rank,
    embedded_engine_footprint,
    forward_layer_bytes,
    fused_weight_grad_bytes,
    hidden_bytes,
    logits_bytes,
    ops_chunk_bytes,
)
from megaopd.config.schema import MegaOPDConfig
from megaopd.engine.config import CUDA_SYNC_EVERY, cache_positions
from megaopd.losses import build_loss_from
from megaopd.models.config import find_hf_config
from megaopd.models.hf_config import params_per_rank, read_hf_config
from megaopd.models.lora import target_linears

GB = 1e9


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
class MemoryPlan:
    items: list[Item]
    gpu_bytes: float
    """The memory the peak must fit in: one GPU's, or (device=cpu) the machine's, which every rank shares."""
    phases: tuple[str, ...] = ("generate", "score", "train")
    notes: list[str] = field(default_factory=list)
    allocator_reserve: float = 0.0
    """Fraction of each phase's itemized bytes the caching allocator keeps reserved (PlanConfig)."""
    device: str = "cuda"
    ranks: int = 1
    """Rank processes sharing gpu_bytes (device=cpu: `megaopd train` starts every rank on this machine)."""

    def allocated(self, phase: str) -> float:
        return sum(getattr(i, phase) for i in self.items)

    def total(self, phase: str) -> float:
        """The phase's bytes as nvidia-smi would show them: the items plus the allocator's reserve."""
        return self.allocated(phase) * (1.0 + self.allocator_reserve)

    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    def peak(self) -> float:
        """The largest phase's bytes: per GPU, or (device=cpu) rank 0's resident memory at its peak."""
        return max(self.total(p) for p in self.phases)

    def needed(self) -> float:
        """What must fit in gpu_bytes: the peak, or on the CPU rank 0's plus the other ranks' (no engine)."""
        engine = max((i.peak() for i in self.items if i.name.startswith("embedded engine")), default=0.0)
        return self.peak() + (self.ranks - 1) * (self.peak() - engine)

    def fits(self) -> bool:
        return self.needed() <= self.gpu_bytes

    def summary(self) -> str:
        """The line `megaopd plan` ends with when the plan fits."""
        if self.device == "cpu":
            return (
                f"fits: peak {self.peak() / GB:.1f} GB ({self.peak_phase()}) per rank process, "
                f"{self.needed() / GB:.1f} GB for the {self.ranks} rank(s) of {self.gpu_bytes / GB:.1f} GB"
            )
        return f"fits: peak {self.peak() / GB:.1f} GB ({self.peak_phase()}) of {self.gpu_bytes / GB:g} GB per GPU"


# ------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class PlanRoles:
    """The models whose memory the plan counts: the student (actor) and the frozen ones beside it."""

    student: RoleLayout
    reference: RoleLayout | None = None
    teacher: RoleLayout | None = None
    """The in-job teacher (one; None when it is served, absent or runs on the reference's model)."""


@dataclass(frozen=True, kw_only=True)
class StepLayout:
    """How the step trains: the world, the micro-batches, the optimizer, attention and logits."""

    world_size: int
    micro_batch_rows: int
    seq_len: int
    use_distributed_optimizer: bool
    flash_attention: bool
    packed_tokens: int = 0
    """> 0 (trainer.pack_sequences=true): the training micro-batch is one packed row of that many tokens
    (config/plan_shape.py), whose sequences are at most seq_len long; micro_batch_rows is then unused. 0:
    micro_batch_rows padded rows of seq_len tokens."""
    logits_chunk_tokens: int = 0
    """> 0: the fused output layer (trainer.logits_chunk_tokens): logits of that many tokens at a time instead
    of the micro-batch's."""
    score: MicroBatchShape | None = None
    """The scoring passes' micro-batch (None: the training one's shape)."""


@dataclass(frozen=True, kw_only=True)
class MachineMemory:
    """What the plan must fit in, and what the machine itself takes of it."""

    gpu_memory_gb: float
    reserved_gb: float
    """NCCL and what is not itemized (GPU only)."""
    cuda_context_gb: float = 0.0
    allocator_reserve: float = 0.0
    device: str = "cuda"
    """cpu: no CUDA context, NCCL margin (reserved_gb) or colocated engine share; process_gb for each rank
    process instead."""
    process_gb: float = 0.0


@dataclass(frozen=True, kw_only=True)
class EngineMemory:
    """The rollout engines' share of the trainer's memory."""

    colocated: bool
    """Served engines on the training GPUs (they hold engine_memory_fraction while generating)."""
    engine_memory_fraction: float
    engine_released_gb: float
    embedded_engine: EmbeddedEngineFootprint | None = None


def build_plan(roles: PlanRoles, step: StepLayout, machine: MachineMemory, engines: EngineMemory) -> MemoryPlan:
    """Bytes per GPU (device=cpu: per rank process) of every item in each phase; pure (no file or device is
    touched). The records' fields say what each input is."""
    student, reference, teacher = roles.student, roles.reference, roles.teacher
    world_size, seq_len, packed_tokens = step.world_size, step.seq_len, step.packed_tokens
    use_distributed_optimizer, flash_attention = step.use_distributed_optimizer, step.flash_attention
    logits_chunk_tokens, device = step.logits_chunk_tokens, machine.device
    cpu = device == "cpu"
    dp = max(1, world_size // (student.tp * student.pp))
    p_actor = params_per_rank(student.hf, student.tp, student.pp, student.ep)
    e = DTYPE_BYTES[student.dtype]
    # A LoRA student trains its adapters only: megatron's DDP and optimizer take trainable parameters, so the
    # gradients and Adam's state are the adapters'; its weights are the frozen base plus the adapters.
    p_adapter = (
        adapter_params_per_rank(student.hf, student.lora_linears, student.lora_rank, student.tp, student.pp)
        if student.lora_rank
        else 0
    )
    p_trained = p_adapter if student.lora_rank else p_actor
    adam = adam_bytes_per_param(student.dtype) * p_trained / (dp if use_distributed_optimizer else 1)
    packed = packed_tokens > 0
    b, s = (1, packed_tokens) if packed else (step.micro_batch_rows, seq_len)
    train = MicroBatchShape(b, s, seq_len, packed)
    score = step.score or train
    # What to lower when a micro-batch's activations or logits do not fit.
    smaller = "lower trainer.max_tokens_per_micro_batch" if packed else "lower trainer.micro_batch_size"
    items = []

    def static(name, nbytes, hint=""):
        items.append(Item(name, nbytes, nbytes, nbytes, hint))

    lora = f" (LoRA r{student.lora_rank}: {p_adapter / 1e6:.3f}M adapter params)" if student.lora_rank else ""
    static(f"student weights{lora}", (p_actor + p_adapter) * e, "raise student.tp (or student.pp)")
    static(
        f"student gradients (fp32{', adapters only' if lora else ''})",
        p_trained * 4.0,
        "raise student.tp (or student.pp)",
    )
    opt_hint = (
        "set optimizer.use_distributed_optimizer=true (shards Adam over the data-parallel ranks)"
        if not use_distributed_optimizer
        else "add data-parallel ranks (more GPUs) or raise student.tp"
    )
    static(
        f"Adam states{' (sharded /' + str(dp) + ')' if use_distributed_optimizer else ''}"
        + (" (adapters only)" if lora else ""),
        adam,
        opt_hint,
    )
    act_hint = (
        "set student.recompute=full"
        if student.recompute != "full"
        else smaller
        if packed or b > 1
        else "raise student.tp with student.sequence_parallel=true"
    )
    if student.recompute != "full" and not student.sequence_parallel and student.tp > 1:
        act_hint += " or student.sequence_parallel=true"
    items.append(
        Item(
            f"student activations ({train.describe()}, recompute={student.recompute}"
            f"{', SP' if student.sequence_parallel else ''})",
            0,
            0,
            activation_bytes(student, b, s, flash_attention, _span(train)),
            act_hint if act_hint == smaller else f"{act_hint}, or {smaller}",
        )
    )
    case = _LogitsCase(
        student=student,
        reference=reference,
        teacher=teacher,
        train=train,
        score=score,
        smaller=smaller,
        flash_attention=flash_attention,
    )
    if logits_chunk_tokens:
        _fused_logits_items(items, case, logits_chunk_tokens)
    else:
        _whole_logits_items(items, case)
    _model_items(items, reference, teacher, offload=not cpu)
    if engines.colocated and not cpu:
        share = engines.engine_memory_fraction * machine.gpu_memory_gb * GB
        rest = engines.engine_released_gb * GB
        items.append(
            Item(
                f"colocated engine (mem fraction {engines.engine_memory_fraction:g}; released: "
                f"{engines.engine_released_gb:g} GB)",
                share,
                rest,
                rest,
                "lower the engines' memory fraction (ENGINE_MEM_FRACTION, plan.engine_memory_fraction) "
                "or give engines their own nodes (ENGINE_NODES)",
            )
        )
    if engines.embedded_engine is not None:
        items.append(_embedded_engine_item(engines.embedded_engine, cpu))
        if engines.embedded_engine.adapter_base and cpu:  # beside a GPU it is host memory, not the GPU's
            static(
                "embedded engine's kept base (LoRA adapter syncs: the adapted weights' base, to merge into)",
                engines.embedded_engine.adapter_base,
                "serve rollouts (rollout.engine=remote)",
            )
    if cpu:
        static("rank process (interpreter, libraries, tokenizer, data, heap)", machine.process_gb * GB)
    else:
        if machine.cuda_context_gb:
            static("CUDA context (one process)", machine.cuda_context_gb * GB)
        static("reserved (NCCL, not itemized)", machine.reserved_gb * GB)
    head = "fused output layer, " + f"{logits_chunk_tokens} tokens a chunk" if logits_chunk_tokens else "whole logits"
    where = "per rank process (CPU, resident memory)" if cpu else "per GPU"
    notes = [
        f"{where} at student tp={student.tp} pp={student.pp} dp={dp}, {p_actor / 1e9:.3f}B student params "
        f"per rank, micro-batch {train.describe()} (scoring: {score.describe()}), "
        f"{'flash' if flash_attention else 'unfused'} attention, {head}"
        + (
            f"; totals include the allocator's reserve (+{machine.allocator_reserve:.0%})"
            if machine.allocator_reserve and not cpu
            else ""
        )
    ]
    return MemoryPlan(
        items,
        machine.gpu_memory_gb * GB,
        notes=notes,
        allocator_reserve=0.0 if cpu else machine.allocator_reserve,
        device=device,
        ranks=world_size if cpu else 1,
    )


def _span(shape: MicroBatchShape) -> int | None:
    """The keys one query attends to at most: a packed row's longest sequence (attention stays within each)."""
    return shape.longest if shape.packed else None


def _model_items(items: list, reference: RoleLayout | None, teacher: RoleLayout | None, offload: bool) -> None:
    """The frozen models' weights (offload_between_uses frees them outside their passes, on a GPU only)."""
    # The reference is in lockstep with the actor: on the GPU whenever the actor trains; offload frees it while
    # engines generate and while the teacher scores. The teacher is resident only while it scores.
    for key, role, train, hint in (
        ("reference", reference, True, "set reference.offload_between_uses=true"),
        ("teacher", teacher, False, "set teacher.offload_between_uses=true or raise teacher.tp"),
    ):
        if role is None or role.weights_shared:
            continue
        w = params_per_rank(role.hf, role.tp, role.pp, role.ep) * DTYPE_BYTES[role.dtype]
        off = 0.0 if role.offload and offload else w
        name = f"{key} weights" + (" (offloaded)" if off == 0 else "")
        items.append(Item(name, off, off, w, hint) if train else Item(name, off, w, off, hint))


def _embedded_engine_item(eng: EmbeddedEngineFootprint, cpu: bool) -> Item:
    """Its weights and KV cache while generating; outside generation, a colocated engine releases its KV cache
    and (on a GPU) offloads its weights; any other keeps both (engine/memory.py: the cache is kept)."""
    kept = (0.0 if eng.colocated and not cpu else eng.weights) + (0.0 if eng.colocated else eng.kv_cache)
    what = "offloaded" if not cpu else "kept"
    return Item(
        f"embedded engine on rank 0 (weights{f'; {what} after generating' if eng.colocated else ''}"
        f"; KV cache{' while generating' if eng.colocated else ''})",
        eng.weights + eng.kv_cache,
        kept,
        kept,
        "set rollout.colocated=true (releases its KV cache and offloads its weights while training), "
        "lower rollout.max_batch_size, or serve rollouts (rollout.engine=remote)",
    )


@dataclass(frozen=True, kw_only=True)
class _LogitsCase:
    """What the logits items of a plan are counted from."""

    student: RoleLayout
    reference: RoleLayout | None
    teacher: RoleLayout | None
    train: MicroBatchShape
    """The training micro-batch."""
    score: MicroBatchShape
    """The scoring passes' micro-batch."""
    smaller: str
    """The hint that makes a micro-batch smaller (packed or padded)."""
    flash_attention: bool


def _fused_logits_items(items: list[Item], case: _LogitsCase, chunk_tokens: int) -> None:
    """The logits items of the fused output layer: chunks of `chunk` tokens, the hidden states, the weight's
    float32 gradient (module docstring)."""
    student, reference, teacher, train, score = case.student, case.reference, case.teacher, case.train, case.score
    smaller, flash_attention = case.smaller, case.flash_attention
    tokens = train.rows * train.tokens
    chunk = min(chunk_tokens, tokens)
    lc = logits_bytes(student, 1, chunk)
    grad_in_reference = reference is not None and reference.dtype == student.dtype
    hid = hidden_bytes(student, tokens)
    # Its output, megatron's [s, b] -> [b, s] copy of it, and its gradient in backward.
    trained = (
        (1 if grad_in_reference else 2) * lc
        + ops_chunk_bytes(student, 1, chunk)
        + fused_weight_grad_bytes(student)
        + 3 * hid
    )
    items.append(
        Item(
            f"student logits (fused: {chunk} tokens a chunk; weight grad fp32; hidden states)",
            0,
            0,
            trained,
            f"lower trainer.logits_chunk_tokens or {smaller}",
        )
    )
    if reference is not None:
        items.append(
            Item(
                "reference logits (fused: its chunk and hidden states)",
                0,
                0,
                logits_bytes(reference, 1, chunk) + hidden_bytes(reference, tokens),
                "lower trainer.logits_chunk_tokens",
            )
        )
    s_tokens = score.rows * score.tokens
    s_chunk = min(chunk_tokens, s_tokens)

    def scoring(role):
        return (
            logits_bytes(role, 1, s_chunk)
            + ops_chunk_bytes(role, 1, s_chunk)
            + 2 * hidden_bytes(role, s_tokens)
            + forward_layer_bytes(role, score.rows, score.tokens, flash_attention, _span(score))
        )

    score_bytes, scorer = max([(scoring(student), "student")] + ([(scoring(teacher), "teacher")] if teacher else []))
    items.append(
        Item(
            f"scoring pass ({scorer}'s, the larger: a logits chunk + one layer)",
            0,
            score_bytes,
            0,
            f"{smaller} or raise {scorer}.tp",
        )
    )


def _whole_logits_items(items: list[Item], case: _LogitsCase) -> None:
    """The logits items when the model's output layer makes the micro-batch's whole logits (module docstring)."""
    student, reference, teacher, train, score = case.student, case.reference, case.teacher, case.train, case.score
    smaller, flash_attention = case.smaller, case.flash_attention
    b, s, padded = train.rows, train.tokens, not train.packed and train.rows > 1
    lg = logits_bytes(student, b, s)
    # Training with the reference in lockstep: the fused backward writes the student's gradient into the
    # reference logits' memory (ops.vocab_parallel_logprobs_kl overwrite_q), so the gradient is no new buffer.
    grad_in_reference = reference is not None and reference.dtype == student.dtype
    # Padded rows (b > 1): logits[:, :-1] of several rows is not contiguous, and the loss's ops each take a
    # contiguous copy of it while megatron still holds the output: one more L (benchmarks/memory.py: 4.5L
    # with the reference, against 2.4L packed).
    student_train = (1 if grad_in_reference else 2) * lg + (lg if padded else 0)
    items.append(
        Item(
            f"student logits ({train.describe()}{'' if grad_in_reference else '; + grad in backward'}"
            f"{'; + shifted copy' if padded else ''})",
            0,
            0,
            student_train + ops_chunk_bytes(student, b, s),
            f"{smaller} or raise student.tp",
        )
    )
    if reference is not None:
        ref_lg = logits_bytes(reference, b, s) * (2 if padded else 1)  # padded: + its shifted copy
        items.append(
            Item(
                "reference logits (lockstep KL" + ("; then the student's grad)" if grad_in_reference else ")"),
                0,
                0,
                ref_lg,
                smaller,
            )
        )

    def scoring(role):
        # The logits (padded rows: megatron's [S, b] -> [b, S] copy of them too) and the ops' chunks.
        sl, chunks = logits_bytes(role, score.rows, score.tokens), ops_chunk_bytes(role, score.rows, score.tokens)
        held = sl + chunks if score.packed or score.rows == 1 else max(2 * sl, sl + chunks)
        return held + forward_layer_bytes(role, score.rows, score.tokens, flash_attention, _span(score))

    # The scoring passes run one after the other (actor's log pi_old, then the teacher's): the larger counts.
    score_bytes, scorer = max([(scoring(student), "student")] + ([(scoring(teacher), "teacher")] if teacher else []))
    items.append(
        Item(
            f"scoring pass ({scorer}'s, the larger: logits + one layer)",
            0,
            score_bytes,
            0,
            f"{smaller} or raise {scorer}.tp",
        )
    )


def format_plan(plan: MemoryPlan) -> str:
    width = max(len(i.name) for i in plan.items) + 2
    head = f"{'item':<{width}}" + "".join(f"{p:>10}" for p in plan.phases)
    lines = [*plan.notes, head, "-" * len(head)]
    for i in plan.items:
        lines.append(f"{i.name:<{width}}" + "".join(f"{getattr(i, p) / GB:>10.2f}" for p in plan.phases))
    lines.append("-" * len(head))
    lines.append(f"{'total (GB)':<{width}}" + "".join(f"{plan.total(p) / GB:>10.2f}" for p in plan.phases))
    memory = "machine memory, all ranks (GB)" if plan.device == "cpu" else "GPU memory (GB)"
    lines.append(f"{memory:<{width}}" + f"{plan.gpu_bytes / GB:>10.2f}" * len(plan.phases))
    return "\n".join(lines)


def explain_overflow(plan: MemoryPlan, top: int = 3) -> str:
    """One message: the phase that overflows, by how much, its biggest items and what to change."""
    phase = plan.peak_phase()
    over = plan.needed() - plan.gpu_bytes
    biggest = sorted(plan.items, key=lambda i: getattr(i, phase), reverse=True)[:top]
    parts = [f"{i.name} {getattr(i, phase) / GB:.1f} GB ({i.hint})" for i in biggest if i.hint]
    if plan.device == "cpu":
        need = f"{plan.needed() / GB:.1f} GB for {plan.ranks} rank process(es)"
        limit = f"the machine's {plan.gpu_bytes / GB:.1f} GB (plan.cpu_memory_gb)"
    else:
        need, limit = f"{plan.total(phase) / GB:.1f} GB per GPU", f"plan.gpu_memory_gb={plan.gpu_bytes / GB:g}"
    return f"does not fit: the {phase} phase needs {need}, {over / GB:.1f} GB more than {limit}; biggest: " + "; ".join(
        parts
    )


def plan_device(cfg: MegaOPDConfig) -> str:
    """plan.device, auto resolved (PlanConfig.device)."""
    if cfg.plan.device != "auto":
        return cfg.plan.device
    dtypes = [cfg.student.dtype, cfg.reference.dtype] + [t.dtype for t in cfg.teachers if t.in_job]
    if any(DTYPE_BYTES[d] < 4 for d in dtypes):
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def step_rows(cfg: MegaOPDConfig, needs) -> StepRows:
    """One step's rows at their budgets (plan.max_tokens, when set, for every row)."""
    t = cfg.trainer
    return StepRows(
        rollout_rows=t.prompts_per_step * t.samples_per_prompt if needs.on_policy else 0,
        rollout_tokens=cfg.plan.max_tokens or cfg.rollout_row_tokens(),
        golden_rows=t.prompts_per_step if needs.golden else 0,
        golden_tokens=cfg.plan.max_tokens or cfg.golden_row_tokens(),
        group=t.samples_per_prompt if needs.rewards else 1,
        mini_batches=t.mini_batches_per_step,
        max_tokens=t.max_tokens_per_micro_batch if t.pack_sequences else 0,
        micro_batch_size=t.micro_batch_size,
    )


def plan_for(cfg: MegaOPDConfig) -> MemoryPlan:
    """The MemoryPlan of a loaded config (reads the models' config.json files): its own rows, on its device."""
    needs = build_loss_from(cfg.loss).needs
    device = plan_device(cfg)
    cpu = device == "cpu"

    def role(name, section, path=None):
        hf = read_hf_config(find_hf_config(path or section.path))
        return RoleLayout(
            name=name,
            hf=hf,
            tp=section.tp,
            pp=section.pp,
            dtype=section.dtype,
            recompute=section.recompute,
            sequence_parallel=section.sequence_parallel,
            offload=section.offload_between_uses and name != "student",
            ep=section.ep,
            cpu=cpu,
        )

    lora = cfg.student.lora
    student = role("student", cfg.student)
    if lora.enabled:
        student = replace(student, lora_rank=lora.rank, lora_linears=target_linears(lora.targets))
    # No reference weights when the LoRA student's base is its reference (MegaOPDConfig.reference_is_the_base,
    # the rule trainer/roles.py follows: the base with its adapters off, no second copy); its lockstep forward
    # still holds its logits (or fused chunk) and hidden states in the training step.
    reference = None
    if needs.reference and cfg.reference_is_the_base():
        reference = replace(student, name="reference", lora_rank=0, lora_linears=(), weights_shared=True)
    elif needs.reference:
        reference = role("reference", cfg.reference, cfg.reference.path or cfg.student.path)
    # The in-job teacher's weights share the GPUs (a served one's do not). build_plan counts one teacher: with
    # several in-job teachers, the first; none when it runs on the reference's model (teacher.path: reference).
    in_job = [t for t in cfg.teachers if t.in_job]
    shared = bool(in_job) and reference is not None and cfg.teacher_shares_reference(in_job[0])
    teacher = role("teacher", in_job[0]) if in_job and not shared else None
    world = cfg.run.world_size
    rows = step_rows(cfg, needs)
    # A teacher's rows are longer by what its context adds (the same on plan.max_tokens's rows).
    longer = [cfg.teacher_row_tokens(t) - cfg.rollout_row_tokens() for t in in_job[:1]]
    shapes = job_shapes(
        rows,
        max(1, world // (student.tp * student.pp)),
        [(max(1, world // (t.tp * t.pp)), rows.rollout_tokens + extra) for t, extra in zip(in_job, longer)],
        student.tp if student.sequence_parallel else 1,
    )
    engine = None
    if cfg.rollout.engine.in_trainer and (needs.on_policy or cfg.validation.path):
        # The embedded engine generates on rank 0 with the student's architecture (rollout/build.py), its KV
        # cache sized to the longest generated row as the engine rounds it on CUDA (megaopd.engine).
        positions = cache_positions(cfg.generated_row_tokens(), CUDA_SYNC_EVERY)
        engine = embedded_engine_footprint(
            student.hf,
            cfg.embedded_engine_dtype(),
            cfg.rollout.max_batch_size,
            positions,
            cfg.rollout.colocated,
            student.lora_linears if cfg.rollout.sends_adapters else (),
        )
    train = shapes.train
    # On the CPU a packed row runs the packed SDPA path (no S x S scores); padded rows megatron's unfused one.
    flash = train.packed if cpu else cfg.plan.attention == "flash"
    memory = (cfg.plan.cpu_memory_gb or _machine_memory_gb()) if cpu else cfg.plan.gpu_memory_gb
    return build_plan(
        PlanRoles(student, reference, teacher),
        StepLayout(
            world_size=world,
            micro_batch_rows=train.rows,
            seq_len=train.longest if train.packed else train.tokens,
            packed_tokens=train.tokens if train.packed else 0,
            score=shapes.score,
            use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
            flash_attention=flash,
            logits_chunk_tokens=cfg.trainer.logits_chunk_tokens,
        ),
        MachineMemory(
            gpu_memory_gb=memory,
            reserved_gb=cfg.plan.reserved_gb,
            cuda_context_gb=cfg.plan.cuda_context_gb,
            allocator_reserve=cfg.plan.allocator_reserve,
            device=device,
            process_gb=cfg.plan.cpu_process_gb,
        ),
        EngineMemory(
            colocated=cfg.rollout.colocated and not cfg.rollout.engine.in_trainer,
            engine_memory_fraction=cfg.plan.engine_memory_fraction,
            engine_released_gb=cfg.plan.engine_released_gb,
            embedded_engine=engine,
        ),
    )


def _machine_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
