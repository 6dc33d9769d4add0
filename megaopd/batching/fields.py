"""The loss's inputs that micro-batches carry, declared once: where each comes from, what it is padded with,
and which losses read it. Padding, packing and the LossInputs record all loop over FIELDS.

    for field, k in needed_fields(needs):                      # what this loss reads (k: keep [..., :k])
        x = field.source(rollout, k)                           # [rows held, T(, K)], or [B] per sequence
    LossInputs(..., **{field.name: field.on_device(v) for field, v in micro_batch.inputs.items()})

Adding a per-token input of the loss: one TokenField below, the LossInputs field of that name, and the loss
that reads it (with its LossNeeds flag). A new kind of score (another pass output) also adds its row to
rollout.records.SCORE_FIELDS and its op to the scoring pass.

Shape legend: B rows of the batch, T = S - 1 positions, K top-k size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from megaopd.losses import LossNeeds
from megaopd.rollout.records import RolloutBatch, TokenScores


def _actor(batch: RolloutBatch) -> TokenScores:
    return batch.actor


def _teacher(batch: RolloutBatch) -> TokenScores:
    return batch.teacher


def _rollout(batch: RolloutBatch) -> RolloutBatch:
    return batch


@dataclass(frozen=True)
class TokenField:
    """One input of the loss as micro-batches carry it (a key of MicroBatch.inputs)."""

    name: str
    """The LossInputs field it fills."""
    holder: Callable[[RolloutBatch], TokenScores | RolloutBatch]
    """The record whose rows it indexes: the actor's or the teacher's TokenScores (this rank's owned rows,
    looked up with TokenScores.index) or the rollout itself (every row)."""
    read: Callable[[Any], torch.Tensor]
    """The tensor in the holder: [rows, T(, K)] per token, [B] per sequence."""
    dtype: torch.dtype
    """As it is carried (ids int32: half the bytes of long)."""
    needed: Callable[[LossNeeds], int | bool]
    """Whether this loss reads it; an int K > 0 also keeps the first K of a top-k ([..., :K])."""
    pad: float | None = 0.0
    """Value at padding and golden positions (rows); None: each padding or golden sequence gets a group of
    its own, B + i, so it joins no real group (group ids)."""
    per_sequence: bool = False
    """One value per sequence ([R] rows padded, [num_seqs] packed) instead of one per position."""
    index: bool = False
    """Token ids: made long on the logits' device, as the gathers index with long."""
    optional: bool = False
    """Carried only when its holder has it (a cross-tokenizer teacher's spans); otherwise the loss reads None."""

    def present(self, batch: RolloutBatch) -> bool:
        """The holder has this field (always, unless the field is optional)."""
        return not self.optional or self.read(self.holder(batch)) is not None

    def source(self, batch: RolloutBatch, k: int | None = None) -> torch.Tensor:
        """The field's tensor in its holder, cut to the first k of a top-k (k None: as it is)."""
        x = self.read(self.holder(batch))
        return x if k is None else x[..., :k]

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """The tensor as LossInputs takes it (already on the logits' device)."""
        return x.long() if self.index else x


OLD_LOGPROBS = TokenField("old_logprobs_BT", _actor, lambda s: s.logprobs_BT, torch.float32, lambda n: n.old_logprobs)
TEACHER_LOGPROBS = TokenField(
    "teacher_logprobs_BT", _teacher, lambda s: s.logprobs_BT, torch.float32, lambda n: n.teacher_logprobs
)
# Spans of a cross-tokenizer teacher (rollout.records.TokenScores.spans_BT), read with its log-probs; -1 at
# padding and golden positions, so that none joins a span.
TEACHER_SPANS = TokenField(
    "teacher_spans_BT",
    _teacher,
    lambda s: s.spans_BT,
    torch.int32,
    lambda n: n.teacher_logprobs,
    pad=-1,
    index=True,
    optional=True,
)
TEACHER_TOPK_IDS = TokenField(
    "teacher_topk_ids_BTK", _teacher, lambda s: s.topk_ids_BTK, torch.int32, lambda n: n.teacher_topk, pad=0, index=True
)
TEACHER_TOPK_LOGPROBS = TokenField(
    "teacher_topk_logprobs_BTK", _teacher, lambda s: s.topk_logprobs_BTK, torch.float32, lambda n: n.teacher_topk
)
STUDENT_TOPK_IDS = TokenField(
    "student_topk_ids_BTK", _actor, lambda s: s.topk_ids_BTK, torch.int32, lambda n: n.student_topk, pad=0, index=True
)
# Scored at exactly the student's top-k ids: already k wide, nothing to cut.
STUDENT_TOPK_TEACHER_LOGPROBS = TokenField(
    "student_topk_teacher_logprobs_BTK",
    _teacher,
    lambda s: s.at_ids_logprobs_BTK,
    torch.float32,
    lambda n: bool(n.student_topk),
)
REWARDS = TokenField(
    "rewards_S", _rollout, lambda b: b.rewards_B, torch.float32, lambda n: n.rewards, per_sequence=True
)
GROUP_IDS = TokenField(
    "group_ids_S", _rollout, lambda b: b.group_ids_B, torch.long, lambda n: n.rewards, pad=None, per_sequence=True
)

# The engine's log-probs of the sampled tokens (replicated with the rollout): loss.off_policy_correction.
ENGINE_LOGPROBS = TokenField(
    "engine_logprobs_BT", _rollout, lambda b: b.engine_logprobs_BT, torch.float32, lambda n: n.engine_logprobs
)

FIELDS: tuple[TokenField, ...] = (
    OLD_LOGPROBS,
    TEACHER_LOGPROBS,
    TEACHER_SPANS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
    STUDENT_TOPK_IDS,
    STUDENT_TOPK_TEACHER_LOGPROBS,
    REWARDS,
    GROUP_IDS,
    ENGINE_LOGPROBS,
)


def needed_fields(needs: LossNeeds, batch: RolloutBatch | None = None) -> list[tuple[TokenField, int | None]]:
    """The fields this loss reads, each with K to keep of a top-k (None: the whole trailing dimension); with
    `batch`, the optional ones only where it has them."""
    out = []
    for f in FIELDS:
        want = f.needed(needs)
        if want and (batch is None or f.present(batch)):
            out.append((f, want if type(want) is int else None))
    return out
