"""FLOPs of an OPD step, for MFU: the model's (what the algorithm needs) and the hardware's (what runs).

    dims = MatmulDims.of(hf)                                   # per model
    f = step_flops(StepWork(student=dims, trained_S=..., actor_scored_S=..., teacher=..., teacher_scored_S=...,
                            reference=dims, recompute="none", fused_head=True))
    f.model_train, f.hardware_train, f.model, f.hardware       # FLOPs of the step, all ranks together

Conventions (Kaplan et al. 2020 / PaLM's "6N", with attention added explicitly):
- N counts the parameters that multiply activations: every layer's projections and MLP, and the output
  layer [V, h] (the embedding lookup multiplies nothing; a tied embedding counts once, as the output layer).
  A forward costs 2N per token, a forward + backward 6N.
- Attention scores and their product with V, per sequence of s tokens, forward: 2 * 2 * L * d * s^2 / 2
  (QK^T and AV, d = heads * head_dim, halved for the causal mask, which flash attention skips);
  forward + backward 3x that.
- Model FLOPs: 6N (+ attention) per trained token (every token of every trained sequence: the model runs on
  prompt and response alike) + 2N (+ attention) per token of each scoring pass on these GPUs (the actor's
  log pi_old, an in-job teacher's log q; a served teacher runs elsewhere). The lockstep reference is not a
  model FLOP: the algorithm needs its log-probs, not another forward per step (they could be cached).
- Hardware FLOPs add what runs on top: the lockstep partner's forward (2N_partner per trained token), the
  activation recomputation (full: one more forward of the layers, 2(N - N_out) + attention per trained token;
  selective: the attention core's forward), and the fused output layer's recomputation of each chunk's
  logits in backward (2 V h per trained token for the student, and for the partner).
MFU = FLOPs / (seconds x GPUs x peak FLOP/s); the trainer logs the training phase's and the step's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class MatmulDims:
    """What a model's FLOPs depend on."""

    params: int
    """N: parameters that multiply activations (layers' projections + MLPs, and the output layer)."""
    output_params: int
    """V x h: the output layer's share of N."""
    layers: int
    attn_dim: int
    """heads x head_dim: the width of the attention scores' products."""

    @classmethod
    def of(cls, hf) -> "MatmulDims":
        """From an HFModelConfig (dense or MoE: a MoE layer counts its top-k experts, the ones a token runs)."""
        h, hd = hf.hidden_size, hf.head_dim
        q, kv = hf.num_attention_heads * hd, hf.num_key_value_heads * hd
        if getattr(hf, "num_experts", 0):
            mlp = hf.moe_topk * 3 * h * hf.moe_intermediate_size + hf.num_experts * h
        else:
            mlp = 3 * h * hf.intermediate_size
        per_layer = h * (q + 2 * kv) + q * h + mlp
        out = hf.vocab_size * h
        return cls(hf.num_layers * per_layer + out, out, hf.num_layers, q)

    def forward(self, lengths: Sequence[int]) -> float:
        """FLOPs of one forward over sequences of these lengths (causal attention within each)."""
        return sum(2.0 * self.params * s + 2.0 * self.layers * self.attn_dim * s * s for s in lengths)

    def attention_forward(self, lengths: Sequence[int]) -> float:
        return sum(2.0 * self.layers * self.attn_dim * s * s for s in lengths)


@dataclass(frozen=True)
class StepWork:
    """What one step ran, over all ranks: models and the sequence lengths each pass saw."""

    student: MatmulDims
    trained_S: Sequence[int]
    """Lengths of the trained sequences (rollouts and golden rows; every optimizer step of the step)."""
    actor_scored_S: Sequence[int] = ()
    """Lengths of the actor's forward-only scoring pass (log pi_old)."""
    teacher: MatmulDims | None = None
    teacher_scored_S: Sequence[int] = ()
    """An in-job teacher's scoring pass (empty for a served teacher: its FLOPs run on other GPUs)."""
    partner: MatmulDims | None = None
    """The frozen model in lockstep with the trained one (reference, or gkd's teacher)."""
    recompute: str = "none"
    """The student's activation recomputation: none | selective | full."""
    fused_head: bool = False
    """The fused output layer (trainer.logits_chunk_tokens > 0) recomputes each chunk's logits in backward."""


@dataclass(frozen=True)
class StepFlops:
    model_train: float
    hardware_train: float
    model: float
    """The whole step's model FLOPs: training + the scoring passes."""
    hardware: float


def step_flops(w: StepWork) -> StepFlops:
    tokens = float(sum(w.trained_S))
    model_train = 3.0 * w.student.forward(w.trained_S)
    extra = 0.0
    if w.recompute == "full":
        extra += w.student.forward(w.trained_S) - 2.0 * w.student.output_params * tokens
    elif w.recompute == "selective":
        extra += w.student.attention_forward(w.trained_S)
    if w.fused_head:
        extra += 2.0 * w.student.output_params * tokens
    if w.partner is not None:
        extra += w.partner.forward(w.trained_S)
        if w.fused_head:
            extra += 2.0 * w.partner.output_params * tokens
    scoring = w.student.forward(w.actor_scored_S)
    if w.teacher is not None:
        scoring += w.teacher.forward(w.teacher_scored_S)
    return StepFlops(model_train, model_train + extra, model_train + scoring, model_train + extra + scoring)


# Dense bf16 tensor-core peaks (TFLOP/s, SXM) of the GPUs the project runs on, by device-name substring.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(device_name: str | None) -> float | None:
    """The bf16 peak of a known GPU (None for another device, or the CPU: no MFU then)."""
    if not device_name:
        return None
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)
