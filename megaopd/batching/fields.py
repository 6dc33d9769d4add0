"""The loss's inputs as micro-batches carry them, read out of the rollout record.

Each input is declared once, by the LossNeeds field that asks for it (losses/needs.py: the LossInputs field it
fills, what computes it, its dtype and pad value); this module only finds its tensor in a RolloutBatch.
Padding, packing and MicroBatch.loss_inputs loop over needed_fields:

    for field, k in needed_fields(needs, rollout):           # what this loss reads (k: keep [..., :k])
        x = value(field, rollout, k)                          # [rows held, T(, K)], or [B] per sequence
    LossInputs(..., **{field.name: field.on_device(v) for field, v in micro_batch.inputs.items()})

Shape legend: B rows of the batch, T = S - 1 positions, K top-k size.
"""

from __future__ import annotations

import torch

from megaopd.losses.needs import LossInput, LossNeeds, Source
from megaopd.rollout.records import RolloutBatch, TokenScores


def holder(field: LossInput, batch: RolloutBatch) -> TokenScores | RolloutBatch:
    """The record whose rows `field` indexes: the actor's or the teacher's TokenScores (this rank's owned rows,
    looked up with TokenScores.index) or the rollout itself (every row)."""
    if field.source is Source.ACTOR:
        return batch.actor
    if field.source is Source.TEACHER:
        return batch.teacher
    return batch


def value(field: LossInput, batch: RolloutBatch, k: int | None = None) -> torch.Tensor:
    """The field's tensor in its holder, cut to the first k of a top-k (k None: as it is)."""
    x = getattr(holder(field, batch), field.read)
    if x is None:
        raise ValueError(
            f"the loss reads {field.name}, but this step's {_RECORDS[field.source]} hold no {field.read} (a pass "
            f"computes what ScoreRequest.for_loss asks of it; a served teacher gives log-probs and top-K only)"
        )
    return x if k is None else x[..., :k]


_RECORDS = {Source.ACTOR: "actor scores", Source.TEACHER: "teacher scores", Source.ROLLOUT: "rollout rows"}


def needed_fields(needs: LossNeeds, batch: RolloutBatch | None = None) -> list[tuple[LossInput, int | None]]:
    """The inputs this loss reads (LossNeeds.inputs), each with K to keep of a top-k (None: the whole trailing
    dimension); with `batch`, an optional one only where its holder has it (a cross-tokenizer teacher's spans)."""
    return [
        (f, k)
        for f, k in needs.inputs()
        if batch is None or not f.optional or getattr(holder(f, batch), f.read) is not None
    ]
