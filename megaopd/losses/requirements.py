"""What a configured loss needs from the trainer, so that the step computes only that.

    needs = loss_requirements(build_loss_from(cfg.loss))
    if needs.reference: ...   # run the reference model in lockstep with the actor

A term with weight 0 needs nothing (composite.py drops it).
"""
from __future__ import annotations

from dataclasses import dataclass

from megaopd.losses.registry import BoundLoss


@dataclass
class LossRequirements:
    old_logprobs: bool = False
    """log pi_old of the sampled tokens (policy ratios: opd, grpo)."""
    teacher_logprobs: bool = False
    """log q of the sampled tokens (opd rewards)."""
    teacher_topk: int = 0
    """Teacher's top-K ids + log-probs per position (lsm, teacher support); 0 = not needed."""
    student_topk: int = 0
    """Student's top-k ids per position, with the teacher's log-probs at them (lsm, student support)."""
    teacher_logits: bool = False
    """The teacher's full logits in the student's sharding (gkd): teacher run in lockstep with the actor."""
    reference: bool = False
    """The reference model's logits in lockstep with the actor (ref_kl)."""
    golden: bool = False
    """Golden solutions in the micro-batches (sft)."""
    rewards: bool = False
    """Verifiable rewards per response (grpo)."""

    @property
    def teacher(self) -> bool:
        """The loss reads the teacher model."""
        return self.teacher_logprobs or bool(self.teacher_topk) or bool(self.student_topk) or self.teacher_logits

    @property
    def on_policy(self) -> bool:
        """The loss needs rollouts (everything but SFT on golden data alone)."""
        return self.old_logprobs or self.teacher or self.reference or self.rewards

    def merge(self, other: "LossRequirements") -> "LossRequirements":
        return LossRequirements(
            old_logprobs=self.old_logprobs or other.old_logprobs,
            teacher_logprobs=self.teacher_logprobs or other.teacher_logprobs,
            teacher_topk=max(self.teacher_topk, other.teacher_topk),
            student_topk=max(self.student_topk, other.student_topk),
            teacher_logits=self.teacher_logits or other.teacher_logits,
            reference=self.reference or other.reference,
            golden=self.golden or other.golden,
            rewards=self.rewards or other.rewards,
        )


def loss_requirements(loss: BoundLoss) -> LossRequirements:
    name, cfg = loss.name, loss.config
    if name in ("stable_opd", "weighted_sum"):
        needs = LossRequirements()
        for _label, weight, term in cfg._bound:
            if weight != 0.0:
                needs = needs.merge(loss_requirements(term))
        return needs
    if name == "opd":
        return LossRequirements(old_logprobs=True, teacher_logprobs=True)
    if name == "grpo":
        return LossRequirements(old_logprobs=True, rewards=True)
    if name == "sft":
        return LossRequirements(golden=True)
    if name == "ref_kl":
        return LossRequirements(reference=True)
    if name == "lsm":
        if cfg.support == "teacher_topk":
            return LossRequirements(teacher_topk=cfg.k)
        return LossRequirements(student_topk=cfg.k)
    if name == "gkd":
        return LossRequirements(teacher_logits=True)
    raise ValueError(f"loss {name!r} declares no requirements: add it to megaopd/losses/requirements.py")
