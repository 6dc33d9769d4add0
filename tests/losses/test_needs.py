"""A loss input is declared once, by the LossNeeds field that asks for it (losses/needs.py): the declarations
name real fields, and the micro-batches' inputs, the passes' requests and whether the step loads a teacher and
makes rollouts all follow from them."""

import dataclasses
import itertools
import typing

import pytest
import torch

from megaopd.batching.fields import needed_fields
from megaopd.batching.micro_batches import MiniBatch, assemble_micro_batches
from megaopd.losses import LOSS_INPUTS, LOSSES, LossInput, LossInputs, LossNeeds, Source, build_loss, loss_input
from megaopd.losses.needs import carries
from megaopd.rollout.records import SCORE_FIELDS, RolloutBatch, TokenScores
from megaopd.scoring.passes import ScoreRequest


def test_every_declared_input_fills_a_loss_input_from_a_field_of_its_record():
    loss_fields = {f.name: f for f in dataclasses.fields(LossInputs)}
    hints = typing.get_type_hints(LossInputs)
    records = {
        Source.ACTOR: {f.name for f in SCORE_FIELDS},
        Source.TEACHER: {f.name for f in SCORE_FIELDS},
        Source.ROLLOUT: {f.name for f in dataclasses.fields(RolloutBatch)},
    }
    assert {f.name for f in SCORE_FIELDS} <= {f.name for f in dataclasses.fields(TokenScores)}
    names = [i.name for i in LOSS_INPUTS]
    assert len(names) == len(set(names)), names
    for i in LOSS_INPUTS:
        assert i.name in loss_fields, f"{i.name}: add the LossInputs field it fills"
        assert hints[i.name] == torch.Tensor | None and loss_fields[i.name].default is None, i.name
        assert i.read in records[i.source], f"{i.name} reads {i.read!r}, no field of the {i.source.value}'s record"
        assert loss_input(i.name) is i
    with pytest.raises(KeyError, match="no LossNeeds field declares the loss input 'nope_BT'"):
        loss_input("nope_BT")


def _every_needs():
    """Every LossNeeds the registered losses make at a few configs, and every flag alone and in pairs."""
    out = [build_loss(name).needs for name in LOSSES if name != "weighted_sum"]  # (which needs its terms)
    out.append(build_loss("weighted_sum", {"terms": [{"name": "grpo"}, {"name": "gkd"}]}).needs)
    out += [build_loss("lsm", {"support": s, "k": 4}).needs for s in ("teacher_topk", "student_topk")]
    flags = [f.name for f in dataclasses.fields(LossNeeds)]
    value = {f: (8 if f.endswith("topk") else True) for f in flags}
    for a, b in itertools.combinations([None, *flags], 2):
        out.append(LossNeeds(**{f: value[f] for f in (a, b) if f is not None}))
    return out


def test_teacher_and_on_policy_follow_from_the_declarations_as_they_were_written():
    """The derived properties equal the hand-written ones they replace (engine_logprobs alone, which no loss
    asks for, now counts as on-policy: the engines' log-probs are made of rollouts)."""
    for n in _every_needs():
        teacher = n.teacher_logprobs or bool(n.teacher_topk) or bool(n.student_topk) or n.teacher_logits
        assert n.teacher == teacher, n
        on_policy = n.old_logprobs or teacher or n.reference or n.rewards
        assert n.on_policy == (on_policy or n.engine_logprobs), n


def test_the_passes_requests_follow_from_the_declarations_as_they_were_written():
    """ScoreRequest.for_loss asks each pass for what the trainer asked by hand before (the loss's top-k, the
    overlap metrics' top-k and entropy), and the teacher for log-probs at the student's top-k with lsm's
    student support."""
    for n, overlap_k in itertools.product(_every_needs(), (0, 16)):
        actor = ScoreRequest.for_loss(n, Source.ACTOR, 0.7, overlap_k)
        teacher = ScoreRequest.for_loss(n, Source.TEACHER, 0.7, overlap_k)
        assert actor == ScoreRequest(0.7, max(n.student_topk, overlap_k), overlap_k > 0), n
        assert teacher == ScoreRequest(0.7, max(n.teacher_topk, overlap_k), overlap_k > 0, bool(n.student_topk)), n


def _rollout(B=4, S=6) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    T = S - 1
    scores = TokenScores(-torch.rand(B, T, generator=g), entropy_BT=torch.rand(B, T, generator=g))
    return RolloutBatch(
        tokens_BS=torch.randint(1, 50, (B, S), generator=g),
        loss_mask_BT=torch.ones(B, T),
        engine_logprobs_BT=-torch.rand(B, T, generator=g),
        prompt_lens_B=torch.full((B,), 2),
        response_lens_B=torch.full((B,), S - 2),
        finish_reasons=["stop"] * B,
        group_ids_B=torch.arange(B) // 2,
        actor=scores,
        teacher=scores,
    )


def test_a_new_loss_input_is_one_declaration():
    """A LossNeeds field declaring an input the code has never seen (the teacher's entropy): the step loads the
    teacher for it, the teacher's pass computes it, and the micro-batches carry it, with no other change."""

    @dataclasses.dataclass(frozen=True)
    class Needs(LossNeeds):
        teacher_entropy: bool = carries(LossInput("teacher_entropy_BT", Source.TEACHER, "entropy_BT"))

    needs = Needs(teacher_entropy=True)
    assert needs.teacher and needs.on_policy
    assert ScoreRequest.for_loss(needs, Source.TEACHER, 1.0).entropy
    assert not ScoreRequest.for_loss(needs, Source.ACTOR, 1.0).entropy
    ((field, k),) = needed_fields(needs)
    assert (field.name, k) == ("teacher_entropy_BT", None)
    rollout = _rollout()
    mini = MiniBatch(rollout, rollout.loss_mask_BT, None, torch.arange(4), None)
    micro = assemble_micro_batches(mini, 0, 1, needs, 4, 0)
    assert torch.equal(micro[0].inputs[field], rollout.teacher.entropy_BT)
    # Scores that lack it (a served teacher gives no entropy): one line naming the input, not a None indexed.
    rollout = dataclasses.replace(rollout, teacher=dataclasses.replace(rollout.teacher, entropy_BT=None))
    mini = MiniBatch(rollout, rollout.loss_mask_BT, None, torch.arange(4), None)
    with pytest.raises(ValueError, match="the loss reads teacher_entropy_BT, but this step's teacher scores hold no"):
        assemble_micro_batches(mini, 0, 1, needs, 4, 0)


def test_an_input_no_pass_computes_is_refused_by_name():
    @dataclasses.dataclass(frozen=True)
    class Needs(LossNeeds):
        teacher_nope: bool = carries(LossInput("teacher_nope_BT", Source.TEACHER, "nope_BT"))

    with pytest.raises(ValueError, match="loss input teacher_nope_BT reads 'nope_BT' of the teacher's pass"):
        ScoreRequest.for_loss(Needs(teacher_nope=True), Source.TEACHER, 1.0)
