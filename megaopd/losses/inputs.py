"""LossInputs: the one record every loss reads, built by the trainer per micro-batch.

Shape legend: B rows of the micro-batch, T positions, v = V/TP the local vocabulary shard (contiguous,
rank r holds ids [r*v, (r+1)*v)), V the full vocabulary, K support size, S sequences in the micro-batch.

Alignment: position t of every [B, T] tensor is about one predicted token: `logits_BTv[b, t]` are the
student's logits for `token_ids_BT[b, t]` (the caller shifts by one before building the record), and
old/teacher/reference log-probs at [b, t] are of that same token. A row may hold one sequence (the
default) or several packed ones (`seq_ids_BT`).

Counts: losses sum over the local tokens and divide by a count of the WHOLE optimizer step (every
micro-batch of every data-parallel rank). The trainer computes the local counts with `local_counts`,
sums them over micro-batches and all-reduces them over DP, and passes the totals; the gradients
accumulated over micro-batches and summed (averaged then rescaled) over DP then equal the gradient of
one big batch exactly. Left as None they default to this micro-batch's own counts (one micro-batch, one
DP rank), which is what a test or a metric-only call wants.

Mapping from megaopd.rollout.records.RolloutBatch (via megaopd.batching.micro_batches): token_ids_BT =
targets_BT, rewards_S = rewards_B, group_ids_S = group_ids_B (rows are sequences). Megatron's logits come
sequence-first [T, B, v]:
transpose them and make them contiguous (the ops otherwise copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from megaopd import ops
from megaopd.ops.head import LogitsHead, tokenwise


@dataclass
class LossInputs:
    """Per-micro-batch tensors for the losses; every loss documents which optional fields it needs."""

    logits_BTv: torch.Tensor | LogitsHead
    """Student logits, local vocab shard [B, T, V/TP], float32/bf16, requires grad; or, from the fused output
    layer (PipelineRunner logits_chunk_tokens > 0), a LogitsHead making them chunk by chunk. Every logits
    field may be either: losses read them only through per-token ops wrapped in ops.head.tokenwise."""
    token_ids_BT: torch.Tensor
    """Sampled (on-policy) token ids [B, T], global vocabulary ids, long."""
    loss_mask_BT: torch.Tensor
    """1 where the token counts in the on-policy losses (response tokens), 0 for prompt/padding/masked."""
    tp_group: Any = None
    """Tensor-parallel group the vocabulary is sharded over; None = one process holds the full vocab."""
    temperature: float = 1.0
    """Sampling temperature of the rollout: every log-prob is of softmax(logits / temperature)."""
    seq_ids_BT: torch.Tensor | None = None
    """Sequence index in [0, S) of each position (packed rows); None = row b is sequence b (S = B)."""

    old_logprobs_BT: torch.Tensor | None = None
    """log pi_old(y_t|s_t), recomputed by the actor before the update (opd, grpo)."""
    teacher_logprobs_BT: torch.Tensor | None = None
    """log q(y_t|s_t) of the sampled token under the teacher (opd); under a cross-tokenizer teacher, its
    span's log-prob spread evenly over the span's student tokens (teacher_spans_BT)."""
    teacher_spans_BT: torch.Tensor | None = None
    """Span index of each position under a cross-tokenizer teacher [B, T] (long; -1: no span); None = every
    token is its own span. A span is a stretch of a sequence's text both tokenizations cover whole
    (megaopd.data.alignment); spans are numbered per sequence (the key is (seq_ids_BT, span)). opd takes
    its reverse-KL reward over whole spans (policy.py)."""
    engine_logprobs_BT: torch.Tensor | None = None
    """log pi_engine(y_t|s_t): the engine's log-prob of the sampled token, under the weights that sampled it
    (loss.off_policy_correction tis / mis)."""
    off_policy: Any = None
    """The OffPolicyCorrection of opd / grpo (off_policy.py); None = none. Set by the BoundLoss."""
    teacher_topk_ids_BTK: torch.Tensor | None = None
    """Teacher's top-K token ids per position, sorted by decreasing log-prob (lsm, support=teacher_topk)."""
    teacher_topk_logprobs_BTK: torch.Tensor | None = None
    """Teacher's full-vocabulary log-probs at teacher_topk_ids_BTK."""
    teacher_topk_mask_BTK: torch.Tensor | None = None
    """Optional validity mask of the teacher's top-K entries (1 = in the support); None = all valid."""
    student_topk_ids_BTK: torch.Tensor | None = None
    """Student's top-k ids (from `student_topk_support`) for lsm support=student_topk."""
    student_topk_teacher_logprobs_BTK: torch.Tensor | None = None
    """Teacher's full-vocabulary log-probs at student_topk_ids_BTK (scored by the teacher)."""
    teacher_logits_BTv: torch.Tensor | None = None
    """Teacher logits in the STUDENT's vocab sharding [B, T, V/TP] (gkd only: it needs full distributions)."""
    ref_logits_BTv: torch.Tensor | None = None
    """Reference-model logits, same sharding as the student's, no grad (ref_kl)."""
    ref_logprobs_BT: torch.Tensor | None = None
    """log pi_ref of the sampled token; if None and needed, computed from ref_logits_BTv."""
    rewards_S: torch.Tensor | None = None
    """Verifiable reward per sequence [S] (grpo)."""
    group_ids_S: torch.Tensor | None = None
    """Prompt group of each sequence [S] (grpo); every group must be whole in this micro-batch."""

    golden_logits_BTv: torch.Tensor | None = None
    """Student logits on golden (SFT) sequences [Bg, Tg, V/TP]; may be logits_BTv itself when golden
    rows share the micro-batch (then golden_mask_BT selects them and loss_mask_BT the on-policy ones)."""
    golden_ids_BT: torch.Tensor | None = None
    """Golden token ids [Bg, Tg] aligned with golden_logits_BTv."""
    golden_mask_BT: torch.Tensor | None = None
    """1 where a golden token counts in the SFT loss."""
    golden_seq_ids_BT: torch.Tensor | None = None
    """Like seq_ids_BT, for the golden rows."""

    global_num_tokens: float | torch.Tensor | None = None
    """Loss tokens (loss_mask_BT) in the whole step, all micro-batches and DP ranks; None = local."""
    global_num_seqs: float | torch.Tensor | None = None
    """Sequences with >= 1 loss token in the whole step; None = local."""
    global_num_golden_tokens: float | torch.Tensor | None = None
    """Golden loss tokens in the whole step; None = local."""
    global_num_golden_seqs: float | torch.Tensor | None = None
    """Golden sequences with >= 1 loss token in the whole step; None = local."""

    fuse_reference: bool = True
    """With ref_logits_BTv given (the trainer passes them only for a weighted ref_kl term), the first of
    student_logprobs / student_ref_kl / student_entropy computes all three in ONE fused pass over the
    logits with one backward into one gradient buffer (ops.vocab_parallel_logprobs_kl) instead of three
    passes and two summed [T, V] gradients. With a k1-k3 ref_kl estimator the exact KL is then an unused
    by-product of the forward pass (no backward cost): set False to skip it."""

    ref_logits_disposable: bool = False
    """The caller drops ref_logits_BTv after this micro-batch's backward (the trainer: the lockstep
    reference's logits): the fused backward then writes the student's gradient into their memory instead of
    a new [T, V] buffer (ops.vocab_parallel_logprobs_kl overwrite_q), one logits-sized buffer less at the
    step's peak. False: ref_logits_BTv stay intact."""

    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        B, T = self.token_ids_BT.shape
        if self.logits_BTv.shape[:2] != (B, T):
            raise ValueError(
                f"logits_BTv {tuple(self.logits_BTv.shape)} and token_ids_BT {(B, T)} differ "
                f"in [B, T]: shift logits and ids so position t predicts token t"
            )
        # Every [B, T] field but the ids themselves and the golden rows' own (which may have another [Bg, Tg]).
        per_token = [
            f.name
            for f in fields(self)
            if f.name.endswith("_BT") and f.name != "token_ids_BT" and not f.name.startswith("golden_")
        ]
        for name in per_token:
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (B, T):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {(B, T)} like token_ids_BT")
        for name in ("teacher_logits_BTv", "ref_logits_BTv"):
            t = getattr(self, name)
            if t is not None and t.shape != self.logits_BTv.shape:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, expected {tuple(self.logits_BTv.shape)}"
                    f" (the student's vocab sharding)"
                )
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (greedy rollouts: use 1.0)")

    # ---- required-field access with an error that names the field -------------------------------------------
    def need(self, name: str, loss: str) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            raise ValueError(
                f"loss {loss!r} needs LossInputs.{name}; the trainer must provide it "
                f"(or drop {loss!r} from the loss config)"
            )
        return value

    # ---- shared, cached per-token quantities (computed once even when several terms use them) -----------------
    def student_logprobs(self) -> torch.Tensor:
        """log pi_theta(y_t|s_t) [B, T] over the full vocabulary; differentiable w.r.t. logits_BTv."""
        if "logprobs" not in self._cache:
            if self._can_fuse_reference():
                self._fused_reference()
            else:
                self._cache["logprobs"] = tokenwise(
                    lambda z, ids: ops.vocab_parallel_logprobs(
                        z, ids, group=self.tp_group, temperature=self.temperature
                    ),
                    self.logits_BTv,
                    self.token_ids_BT,
                )
        return self._cache["logprobs"]

    def student_entropy(self) -> torch.Tensor:
        """H(pi_theta(.|s_t)) [B, T], a metric only (no grad)."""
        if "entropy" not in self._cache:
            # Fusing from here under no_grad would cache log-probs without a graph: compute it alone then.
            if self._can_fuse_reference() and torch.is_grad_enabled():
                self._fused_reference()
            else:
                with torch.no_grad():
                    self._cache["entropy"] = tokenwise(
                        lambda z: ops.vocab_parallel_entropy(z, group=self.tp_group, temperature=self.temperature),
                        self.logits_BTv.detach(),
                    )
        return self._cache["entropy"]

    def student_ref_kl(self, loss: str) -> torch.Tensor:
        """Exact KL(pi_theta || pi_ref) [B, T] over the full vocabulary (reference frozen); differentiable
        w.r.t. logits_BTv. Needs ref_logits_BTv."""
        if "ref_kl" not in self._cache:
            ref_logits = self.need("ref_logits_BTv", loss)
            if self._can_fuse_reference():
                self._fused_reference()
            else:
                self._cache["ref_kl"] = tokenwise(
                    lambda z, q: ops.vocab_parallel_kl(z, q, group=self.tp_group, temperature=self.temperature),
                    self.logits_BTv,
                    ref_logits.detach(),
                )
        return self._cache["ref_kl"]

    def _can_fuse_reference(self) -> bool:
        return (
            self.fuse_reference
            and self.ref_logits_BTv is not None
            and "logprobs" not in self._cache
            and "ref_kl" not in self._cache
        )

    def _fused_reference(self) -> None:
        """Student log-probs, exact KL to the reference and (if not cached yet) the entropy metric from one
        fused pass; see `fuse_reference`."""
        with_entropy = "entropy" not in self._cache
        logprobs_BT, kl_BT, entropy_BT = tokenwise(
            lambda z, ids, q: ops.vocab_parallel_logprobs_kl(
                z,
                ids,
                q,
                group=self.tp_group,
                temperature=self.temperature,
                with_entropy=with_entropy,
                # A LogitsHead's reference chunk is made for this op alone: always disposable.
                overwrite_q=self.ref_logits_disposable or isinstance(self.ref_logits_BTv, LogitsHead),
            ),
            self.logits_BTv,
            self.token_ids_BT,
            self.ref_logits_BTv.detach(),
        )
        self._cache["logprobs"], self._cache["ref_kl"] = logprobs_BT, kl_BT
        if entropy_BT is not None:
            self._cache["entropy"] = entropy_BT

    def reference_logprobs(self, loss: str) -> torch.Tensor:
        """log pi_ref(y_t|s_t) [B, T] (no grad): ref_logprobs_BT, else from ref_logits_BTv."""
        if self.ref_logprobs_BT is not None:
            return self.ref_logprobs_BT.detach()
        if "ref_logprobs" not in self._cache:
            ref_logits = self.need("ref_logits_BTv", loss)
            with torch.no_grad():
                self._cache["ref_logprobs"] = tokenwise(
                    lambda z, ids: ops.vocab_parallel_logprobs(
                        z, ids, group=self.tp_group, temperature=self.temperature
                    ),
                    ref_logits.detach(),
                    self.token_ids_BT,
                )
        return self._cache["ref_logprobs"]

    def zero_loss(self) -> torch.Tensor:
        """0.0 connected to the student's logits (or, for a LogitsHead, its hidden states and weight): the loss
        of a step whose terms all weigh 0 still has a graph to backpropagate."""
        logits = self.logits_BTv
        return logits.zero() if isinstance(logits, LogitsHead) else logits.sum() * 0.0

    def seq_ids(self) -> torch.Tensor:
        """[B, T] sequence index of every position (row index when not packed)."""
        if self.seq_ids_BT is not None:
            return self.seq_ids_BT
        B, T = self.token_ids_BT.shape
        return torch.arange(B, device=self.token_ids_BT.device)[:, None].expand(B, T)

    def num_seqs(self) -> int:
        """S: sequences indexed by seq_ids in this micro-batch."""
        if self.rewards_S is not None:
            return int(self.rewards_S.shape[0])
        if self.seq_ids_BT is None:
            return int(self.token_ids_BT.shape[0])
        return int(self.seq_ids_BT.max().item()) + 1 if self.seq_ids_BT.numel() else 0


def local_counts(mask_BT: torch.Tensor, seq_ids_BT: torch.Tensor | None = None) -> tuple[float, float]:
    """(loss tokens, sequences with >= 1 loss token) of one micro-batch: summed by the trainer over the
    micro-batches of a step and all-reduced over DP to make the global_num_* fields."""
    mask = mask_BT.bool()
    if seq_ids_BT is None:
        seq_ids_BT = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
    n_tokens = float(mask.sum().item())
    n_seqs = float(torch.unique(seq_ids_BT[mask]).numel())
    return n_tokens, n_seqs


def all_reduce_counts(counts: list[float], group=None) -> list[float]:
    """Sums counts over a (data-parallel) group; a convenience for the trainer."""
    from megaopd.parallel.dist import device

    t = torch.tensor(counts, dtype=torch.float64, device=device())
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t.tolist()
