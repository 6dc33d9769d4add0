"""The whole job's config: one section per package, composed here.

    megaopd train examples/tiny/stable_opd.yaml run.dir=runs/x trainer.max_steps=3

Sections: run, student, reference, teacher (ModelConfig each), trainer, optimizer, logging, rollout,
loss (megaopd.losses), data (megaopd.data), metrics, validation, plan (`megaopd plan` only).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megaopd.config.model import ModelConfig, check_context, check_layout
from megaopd.config.sections import MetricsConfig, PlanConfig, RolloutConfig, ValidationConfig
from megaopd.config.trainer import LoggingConfig, OptimizerConfig, RunConfig, TrainerConfig
from megaopd.data.config import DataConfig
from megaopd.losses import LossConfig


@dataclass
class MegaOPDConfig:
    run: RunConfig = field(default_factory=RunConfig)
    student: ModelConfig = field(default_factory=ModelConfig)
    """The actor being trained; the reference shares its layout."""
    reference: ModelConfig = field(default_factory=ModelConfig)
    """The student's initial weights for the reference KL; an empty path means student.path."""
    teacher: ModelConfig = field(default_factory=ModelConfig)
    """Forward-only scorer, with its own tp/pp over the same ranks."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    """Read only by `megaopd plan` (the GPU's memory, the engines' share); the trainer ignores it."""

    def max_row_tokens(self, needs) -> tuple[int, str]:
        """The longest row the job builds (prompt + the longest response it generates or trains on)."""
        parts = {"rollout.max_new_tokens": self.rollout.max_new_tokens if needs.on_policy else 0,
                 "data.max_golden_len": self.data.max_golden_len if needs.golden else 0,
                 "validation.max_new_tokens": self.validation.max_new_tokens if self.validation.path else 0}
        key = max(parts, key=parts.get)
        return (self.data.max_prompt_len + parts[key],
                f"data.max_prompt_len={self.data.max_prompt_len} + {key}={parts[key]}")

    def validate(self) -> None:
        """Cross-section checks that need the files on disk: run once at start-up, before any model loads."""
        from megaopd.losses import build_loss_from
        needs = build_loss_from(self.loss).needs  # unknown loss names and keys fail here
        world = self.run.world_size
        student_dims = check_layout("student", self.student, world)
        if needs.teacher and not self.teacher.path:
            raise ValueError(f"loss {self.loss.name!r} needs a teacher: set teacher.path=DIR (an HF directory or a "
                             f"megaopd checkpoint)")
        tokens, why = self.max_row_tokens(needs)
        check_context("student", self.student.path, student_dims, tokens, why)
        if self.teacher.path:
            # Embedding sizes may differ within a family (Qwen2.5-Math-1.5B 151936 vs 7B 152064): what must
            # match is the tokenizer, which the trainer compares before loading any model.
            teacher_dims = check_layout("teacher", self.teacher, world)
            check_context("teacher", self.teacher.path, teacher_dims, tokens, why)
        ref_layout = (self.reference.tp, self.reference.pp, self.reference.ep)
        student_layout = (self.student.tp, self.student.pp, self.student.ep)
        if ref_layout != student_layout:
            raise ValueError(
                f"reference.tp/pp/ep={ref_layout} differ from student.tp/pp/ep={student_layout}: the reference must "
                f"share the student's layout so their vocab shards and expert groups line up; set "
                f"reference.tp={self.student.tp} reference.pp={self.student.pp} reference.ep={self.student.ep}")
        if self.reference.path:
            ref_dims = check_layout("reference", self.reference, world)
            if ref_dims != student_dims:
                raise ValueError(f"reference {self.reference.path} has other sizes than student "
                                 f"{self.student.path} ({ref_dims} vs {student_dims}): the reference must be "
                                 f"the student's initial checkpoint")
        if (self.trainer.prompts_per_step * self.trainer.samples_per_prompt) % self.trainer.mini_batches_per_step:
            raise ValueError("trainer.prompts_per_step*samples_per_prompt must be a multiple of "
                             "trainer.mini_batches_per_step")
        self.data.validate()
