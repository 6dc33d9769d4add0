"""What a loss reads from the trainer (LossNeeds), each input declared once.

The LossNeeds field that asks for an input declares it: the LossInputs fields it fills, and what computes each
(the actor's scoring pass, the teachers', or the rollout record itself) with its dtype and pad value. The rest
follows from that one declaration:
- the micro-batches carry exactly the declared inputs of the loss's needs (batching/fields.py: needed_fields);
- each model's scoring pass computes the scores they read of it (scoring/passes.py: ScoreRequest.for_loss);
- the step loads a teacher and makes rollouts when an input needs them (LossNeeds.teacher, .on_policy).

    needs = LossNeeds(old_logprobs=True, teacher_topk=32)
    for field, k in needs.inputs():      # LossInput, and the K of a top-k to keep ([..., :K]; None: all)
        field.name, field.source, field.read   # "teacher_topk_ids_BTK", Source.TEACHER, "topk_ids_BTK"

Why it lives here: losses/ is on floor 1 (docs/architecture.md), a library, and the lowest package that
reads the declaration (the losses register their needs with it); the packages that act on it (batching/ 4,
scoring/ 5, trainer/ 7) sit above and import it. It cannot move up beside the records that hold the values
(TokenScores and RolloutBatch, on rollout's floor 3): a library never imports an application. So each
declaration names the field of its record rather than importing the record; batching/fields.py and
scoring/passes.py resolve the names, and tests/losses/test_needs.py checks that every one exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

import torch


class Source(Enum):
    """What computes a loss input's value: a model's scoring pass before the update, or the rollout itself."""

    ACTOR = "actor"
    """The actor's pass: RolloutBatch.actor, a TokenScores of this rank's owned rows (log pi_old, top-k)."""
    TEACHER = "teacher"
    """The teachers' passes: RolloutBatch.teacher, a TokenScores (log q, top-K, log q at the student's ids)."""
    ROLLOUT = "rollout"
    """The rollout record: RolloutBatch itself, every row (the engines' log-probs, rewards, prompt groups)."""


@dataclass(frozen=True)
class LossInput:
    """One LossInputs field that micro-batches carry (a key of MicroBatch.inputs), and where its value comes from."""

    name: str
    """The LossInputs field it fills."""
    source: Source
    """What computes it."""
    read: str
    """Its tensor in the source's record: a TokenScores field for a pass (which the pass's ScoreRequest then
    asks for), a RolloutBatch field for the rollout. [rows, T(, K)] per token, [B] per sequence."""
    dtype: torch.dtype = torch.float32
    """As it is carried (ids int32: half the bytes of long)."""
    pad: float | None = 0.0
    """Value at padding and golden positions (rows); None: each padding or golden sequence gets a group of
    its own, B + i, so it joins no real group (group ids)."""
    per_sequence: bool = False
    """One value per sequence ([R] rows padded, [num_seqs] packed) instead of one per position."""
    index: bool = False
    """Token ids: made long on the logits' device, as the gathers index with long."""
    optional: bool = False
    """Carried only when its record has it (a cross-tokenizer teacher's spans); otherwise the loss reads None."""

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """The tensor as LossInputs takes it (already on the logits' device)."""
        return x.long() if self.index else x


def carries(*inputs: LossInput, default: bool | int = False):
    """A LossNeeds field that, set, has the micro-batches carry `inputs`; an int K > 0 also keeps the first K of
    each ([..., :K]: a top-k scored wider for the overlap metrics is cut to the loss's)."""
    return field(default=default, metadata={"inputs": inputs})


@dataclass(frozen=True)
class LossNeeds:
    """What a loss reads from the trainer beyond the student's logits and the sampled tokens."""

    old_logprobs: bool = carries(LossInput("old_logprobs_BT", Source.ACTOR, "logprobs_BT"))
    """log pi_old of the sampled tokens (policy ratios: opd, grpo)."""
    teacher_logprobs: bool = carries(
        LossInput("teacher_logprobs_BT", Source.TEACHER, "logprobs_BT"),
        # A cross-tokenizer teacher's spans, read with its log-probs; -1 at padding and golden positions, so
        # that none joins a span.
        LossInput("teacher_spans_BT", Source.TEACHER, "spans_BT", torch.int32, pad=-1, index=True, optional=True),
    )
    """log q of the sampled tokens (opd rewards)."""
    teacher_topk: int = carries(
        LossInput("teacher_topk_ids_BTK", Source.TEACHER, "topk_ids_BTK", torch.int32, index=True),
        LossInput("teacher_topk_logprobs_BTK", Source.TEACHER, "topk_logprobs_BTK"),
        default=0,
    )
    """Teacher's top-K ids + log-probs per position (lsm, teacher support); 0 = not needed."""
    student_topk: int = carries(
        LossInput("student_topk_ids_BTK", Source.ACTOR, "topk_ids_BTK", torch.int32, index=True),
        LossInput("student_topk_teacher_logprobs_BTK", Source.TEACHER, "at_ids_logprobs_BTK"),
        default=0,
    )
    """Student's top-k ids per position, with the teacher's log-probs at them (lsm, student support)."""
    teacher_logits: bool = False
    """The teacher's full logits in the student's sharding (gkd): teacher run in lockstep with the actor."""
    reference: bool = False
    """The reference model's logits in lockstep with the actor (ref_kl)."""
    golden: bool = False
    """Golden solutions in the micro-batches (sft)."""
    rewards: bool = carries(
        LossInput("rewards_S", Source.ROLLOUT, "rewards_B", per_sequence=True),
        LossInput("group_ids_S", Source.ROLLOUT, "group_ids_B", torch.long, pad=None, per_sequence=True),
    )
    """Verifiable rewards per response (grpo)."""
    engine_logprobs: bool = carries(LossInput("engine_logprobs_BT", Source.ROLLOUT, "engine_logprobs_BT"))
    """The engine's log-probs of the sampled tokens (loss.off_policy_correction tis / mis)."""

    def inputs(self) -> list[tuple[LossInput, int | None]]:
        """The inputs micro-batches carry for this loss, in declaration order, each with the K to keep of a
        top-k (None: the whole trailing dimension). The lockstep logits (teacher_logits, reference) and the
        golden rows are not carried inputs: MicroBatch.loss_inputs fills them."""
        out = []
        for f in dataclasses.fields(self):
            want = getattr(self, f.name)
            if want:
                out += [(i, want if type(want) is int else None) for i in f.metadata.get("inputs", ())]
        return out

    @property
    def teacher(self) -> bool:
        """The loss reads the teacher model: an input its passes compute, or its logits in lockstep."""
        return self.teacher_logits or any(i.source is Source.TEACHER for i, _ in self.inputs())

    @property
    def on_policy(self) -> bool:
        """The loss needs rollouts (everything but SFT on golden data alone): every carried input is made
        of them, and so are the lockstep teacher's and reference's logits."""
        return bool(self.inputs()) or self.teacher or self.reference

    def merge(self, other: "LossNeeds") -> "LossNeeds":
        """What two losses summed need: the union (the larger top-k)."""
        return LossNeeds(
            **{
                f.name: max(getattr(self, f.name), getattr(other, f.name))  # or, for bools
                for f in dataclasses.fields(self)
            }
        )


LOSS_INPUTS: tuple[LossInput, ...] = tuple(
    i for f in dataclasses.fields(LossNeeds) for i in f.metadata.get("inputs", ())
)
"""Every declared input, in declaration order (the tests check each against LossInputs and its record)."""


def loss_input(name: str) -> LossInput:
    """The declared input that fills LossInputs.`name`."""
    for i in LOSS_INPUTS:
        if i.name == name:
            return i
    raise KeyError(f"no LossNeeds field declares the loss input {name!r}; declared: {[i.name for i in LOSS_INPUTS]}")
