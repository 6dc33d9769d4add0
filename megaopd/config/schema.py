"""The whole job's config: one section per package, composed here.

    megaopd train examples/tiny/stable_opd.yaml run.dir=runs/x trainer.max_steps=3

Sections, each a dataclass owned by the package that builds from it: student, reference (ModelConfig,
models/config.py); teacher or teachers (TeacherConfig, scoring/config.py: in the job or remote; a named
list routed per data source); run, trainer, optimizer, logging, validation (trainer/config.py); rollout
(rollout/config.py); loss (megaopd.losses); data (data/config.py); metrics (metrics/config.py); plan
(config/plan.py, `megaopd plan` only). This module is the top floor: it imports every package's section
and no package imports it (the trainer names MegaOPDConfig in annotations only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import ClassVar, List

from megaopd.config.model_vocab import check_model_vocab, cross_tokenizer_teachers
from megaopd.config.plan_config import PlanConfig
from megaopd.data.config import DataConfig
from megaopd.data.teacher_view import context_fields
from megaopd.envs.config import EnvConfig
from megaopd.losses import LossConfig, check_cross_tokenizer, resolve_correction
from megaopd.metrics.config import MetricsConfig
from megaopd.models.checkpoint import saved_lora
from megaopd.models.config import ModelConfig, StudentConfig, check_context, check_lora, check_role_layout
from megaopd.models.hf_io import tokenizer_dir
from megaopd.rollout.config import RolloutConfig
from megaopd.scoring.config import TeacherConfig
from megaopd.trainer.config import LoggingConfig, OptimizerConfig, RunConfig, TrainerConfig, ValidationConfig


@dataclass
class MegaOPDConfig:
    run: RunConfig = field(default_factory=RunConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    """The actor being trained (a ModelConfig, plus student.lora); the reference shares its layout."""
    reference: ModelConfig = field(default_factory=ModelConfig)
    """The student's initial weights for the reference KL; an empty path means student.path."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """Input shorthand for a one-teacher job: a forward-only Megatron scorer with its own tp/pp over the
    same ranks (engine megatron), or SGLang servers scoring by prefill (engine remote, urls). Loading folds
    it into `teachers` (named "teacher" unless it has a name) and leaves this section empty."""
    teachers: List[TeacherConfig] = field(default_factory=list)
    """The job's teachers, named (each megatron or remote): the one list code reads. With several, every data
    source names its teacher (data.sources[].teacher) and each sample is scored by its prompt's source's."""
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
    env: EnvConfig = field(default_factory=EnvConfig)
    """The multi-turn environment (megaopd.envs); name "" (the default): single-turn rows."""

    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "trainer.log_interval": "it was never read: every step is logged",
        "metrics.collapse.jump": "each watched rate has its own thresholds now: set "
        "metrics.collapse.truncation_rate.jump and metrics.collapse.repetition_rate.jump instead",
        "metrics.collapse.level": "each watched rate has its own thresholds now: set "
        "metrics.collapse.truncation_rate.level and metrics.collapse.repetition_rate.level instead",
    }
    """Keys a config may still name from an older megaopd (or a key under them), and why they went: load_config
    stops at them with that reason (an unknown key would only say it is unknown)."""
    RESET_ON_CHANGE: ClassVar[dict[str, str]] = {"loss.name": "loss.config"}
    """A command-line override that changes the key's value resets the dependent key to its default first
    (load.py): a YAML's loss.config holds the keys of its own loss, never of the one switched to."""

    def __post_init__(self):
        # One teacher list, made while the config is built (OmegaConf.to_object runs this), so that nothing
        # changes the config after load and no reader has to know about the shorthand.
        if self.teacher.configured:
            if self.teachers:
                raise ValueError(
                    "both `teacher` and `teachers` are set: use `teacher` for one teacher or "
                    "`teachers` (a named list) for several, not both"
                )
            self.teachers = [replace(self.teacher, name=self.teacher.name or "teacher")]
            self.teacher = TeacherConfig()
        names = [t.name for t in self.teachers]
        if any(not n for n in names) or len(set(names)) != len(names):
            raise ValueError(f"teachers[].name must be set and distinct, got {names}")
        # teacher.path: reference = the student's initial weights, as the reference reads them (roles.py then
        # shares the reference's model with the teacher when the loss loads one: no second copy).
        self.teachers = [
            replace(t, path=self.reference.path or self.student.path) if t.is_reference else t for t in self.teachers
        ]
        # loss.off_policy_correction=auto becomes what the job runs (none, or tis where rollouts lag).
        self.loss.off_policy_correction = resolve_correction(self.loss, self.rollout.mode != "sync")
        # rollout.lora_sync=auto becomes what the job sends (adapter or merged) when the student has adapters.
        self.rollout.resolve_lora_sync(self.student.lora.enabled)

    def max_row_tokens(self, needs) -> tuple[int, str]:
        """The longest row the job builds (prompt + the longest response it generates or trains on)."""
        parts = {
            "rollout.max_new_tokens": self.rollout.max_new_tokens if needs.on_policy else 0,
            "rollout.max_trajectory_tokens": self.rollout.max_trajectory_tokens
            if needs.on_policy and self.env.enabled
            else 0,
            "data.max_golden_len": self.data.max_golden_len if needs.golden else 0,
            "validation.max_new_tokens": self.validation.max_new_tokens if self.validation.path else 0,
        }
        key = max(parts, key=parts.get)
        return (
            self.data.max_prompt_len + parts[key],
            f"data.max_prompt_len={self.data.max_prompt_len} + {key}={parts[key]}",
        )

    def teacher_shares_reference(self, t: TeacherConfig) -> bool:
        """Whether in-job teacher `t`, when the loss loads a reference, runs on the reference's model
        (trainer.roles.build_models): the reference's weights (teacher.path: reference resolves to them) in the
        student's layout, dtype and offloading, so one frozen copy serves both; `megaopd plan` then counts no
        second copy."""
        return (
            t.in_job
            and (t.tp, t.pp, t.ep) == (self.student.tp, self.student.pp, self.student.ep)
            and t.path == (self.reference.path or self.student.path)
            and t.dtype == self.student.dtype
            and t.offload_between_uses == self.reference.offload_between_uses
        )

    def reference_is_the_base(self) -> bool:
        """A LoRA student whose reference is its own initial weights (reference.path empty or the student's) reads
        the reference from itself with the adapters off (models/lora: bit-exact), unless an in-job teacher is that
        reference too (it then keeps the frozen copy it shares): no reference model is loaded, and `megaopd plan`
        counts none. The one rule: trainer/roles.py and config/plan.py both read it."""
        if not self.student.lora.enabled or self.reference.path not in ("", self.student.path):
            return False
        return not any(self.teacher_shares_reference(t) for t in self.teachers)

    def teacher_row_tokens(self, t: TeacherConfig) -> int:
        """The longest row teacher `t` scores, counted in the student's tokens (`megaopd plan`): the rollout row,
        and for a context of its own what the context may add over the student's prompt: data.max_golden_len for
        each of {golden} and {answer}, data.instruction's characters for {instruction}, and the template's own
        text at one token per character (a bound: no token is shorter). {problem} is the prompt's. A teacher of
        another vocabulary (teacher.tokenizer: own) may cut the same text into more tokens: this counts them as
        the student's."""
        if not t.context:
            return self.rollout_row_tokens()
        fields = context_fields(t.context)
        literal = t.context
        for name in fields:
            literal = literal.replace("{" + name + "}", "")
        extra = len(literal) + len(self.data.instruction or "") * ("instruction" in fields)
        extra += self.data.max_golden_len * sum(f in fields for f in ("golden", "answer"))
        return self.rollout_row_tokens() + extra

    def rollout_row_tokens(self) -> int:
        """The longest row a training rollout makes (prompt + response, or prompt + a whole multi-turn
        trajectory): what the scoring passes and the training step hold of one on-policy row (`megaopd plan`,
        `megaopd plan --step-time`)."""
        new = max(self.rollout.max_new_tokens, self.rollout.max_trajectory_tokens if self.env.enabled else 0)
        return self.data.max_prompt_len + new

    def rollout_row_why(self) -> str:
        """What rollout_row_tokens adds up (for error messages)."""
        budget = "rollout.max_trajectory_tokens" if self.env.enabled else "rollout.max_new_tokens"
        new = self.rollout_row_tokens() - self.data.max_prompt_len
        return f"data.max_prompt_len={self.data.max_prompt_len} + {budget}={new}"

    def golden_row_tokens(self) -> int:
        """The longest golden row (prompt + golden solution) the losses that train on them read."""
        return self.data.max_prompt_len + self.data.max_golden_len

    def generated_row_tokens(self) -> int:
        """The longest row the engines generate (a rollout's, or a validation answer's): what the embedded
        engine's KV cache is sized for (rollout/build.py) and what `megaopd plan` counts for it."""
        validation = self.data.max_prompt_len + self.validation.max_new_tokens if self.validation.path else 0
        return max(self.rollout_row_tokens(), validation)

    def embedded_engine_dtype(self) -> str:
        """The embedded engine's dtype: rollout.engine_dtype, auto = the student's."""
        return self.student.dtype if self.rollout.engine_dtype == "auto" else self.rollout.engine_dtype

    def parity_dtype(self) -> str:
        """What the parity probe's bounds follow (scoring/parity.py bounds_for): the student's dtype, except that
        the tight float32 bound also needs the embedded engine in float32."""
        if self.rollout.engine.in_trainer and self.student.dtype == "float32":
            return self.embedded_engine_dtype()
        return self.student.dtype

    def validate(self) -> None:
        """Cross-section checks that need the files on disk: run once at start-up, before any model loads."""
        from megaopd.losses import build_loss_from

        needs = build_loss_from(self.loss).needs  # unknown loss names and keys fail here
        world = self.run.world_size
        student_dims = check_role_layout("student", self.student, world)
        check_lora(self.student.lora, student_dims)
        # A LoRA checkpoint as student.path: its adapters are rebuilt before it loads, or refused here (never dropped).
        saved_lora(self.student.path, "student", self.student.lora if self.student.lora.enabled else None, True)
        teachers = self.teachers
        if needs.teacher and not teachers:
            raise ValueError(
                f"loss {self.loss.name!r} needs a teacher: set teacher.path=DIR (an HF directory or a "
                f"megaopd checkpoint), or teacher.engine=remote with teacher.urls"
            )
        tokens, why = self.max_row_tokens(needs)
        check_context("student", self.student.path, student_dims, tokens, why)
        for i, t in enumerate(teachers):
            # The `teacher:` shorthand's errors name its keys (teacher.tp, ...), as the user wrote them.
            key = "teacher" if len(teachers) == 1 and t.name == "teacher" else f"teachers[{i}] ({t.name})"
            if t.in_job:
                # Embedding sizes may differ within a family (Qwen2.5-Math-1.5B 151936 vs 7B 152064): what must
                # match is the tokenizer, which the trainer compares before loading any model, and the rows must
                # cover the student's ids (check_model_vocab, below).
                teacher_dims = check_role_layout(key, t, world)
                if "{golden}" in t.context:  # its own rows: the prompt with the golden in it, then the response
                    golden = self.data.max_golden_len
                    rows = self.rollout_row_tokens() + golden
                    check_context(
                        key,
                        t.path,
                        teacher_dims,
                        rows,
                        f"{self.rollout_row_why()} + {key}.context's {{golden}}: data.max_golden_len={golden}",
                    )
                else:
                    check_context(key, t.path, teacher_dims, tokens, why)
                continue
            if not t.urls:
                raise ValueError(f"{key}.engine=remote has no urls: set {key}.urls=[http://HOST:PORT, ...]")
            if not t.path:
                raise ValueError(
                    f"{key}.engine=remote needs path=DIR of the teacher's HF directory (only its "
                    f"tokenizer is read: the teacher must share the student's vocabulary)"
                )
            if self.rollout.temperature != 1.0:
                raise ValueError(
                    f"{key}.engine=remote with rollout.temperature={self.rollout.temperature}: SGLang scores "
                    f"prompts (the prefill of the responses) at temperature 1 only, and a top-K cannot be "
                    f"renormalized at another temperature; use rollout.temperature=1.0 or an in-job teacher "
                    f"(engine=megatron)"
                )
            if needs.student_topk:
                raise ValueError(
                    f"{key}.engine=remote cannot score the teacher at the student's top-k (loss "
                    f"{self.loss.name!r} needs it): SGLang's token_ids_logprob takes one id list per request, "
                    f"not one per position; use the teacher's support (loss support=teacher_topk) or engine=megatron"
                )
            if needs.teacher_logits:
                raise ValueError(f"{key}.engine=remote cannot give the full logits gkd reads: use engine=megatron")
        if needs.teacher_logits and len(teachers) > 1:
            raise ValueError(
                "gkd runs one teacher in lockstep with the actor: it cannot route between several "
                "teachers; use one `teacher:` section"
            )
        self._check_routing(teachers)
        self._check_teacher_views(teachers, needs)
        cross = cross_tokenizer_teachers(self)  # teacher.tokenizer=own of another vocabulary
        self._check_cross_tokenizer(teachers, cross)
        check_model_vocab(self, needs, cross)  # every model's embedding covers the student's ids, before any loads
        if self.validation.path and not os.path.isfile(self.validation.path):
            raise ValueError(
                f"validation.path={self.validation.path!r} is not a file: point it at a benchmark-"
                f"format jsonl (id, problem, answer), or set validation.path='' to disable validation"
            )
        if self.env.enabled and self.data.teacher_prompt == "own":
            raise ValueError(
                f"env.name={self.env.name} with data.teacher_prompt=own: a trajectory's tool turns are "
                f"rendered by the student's chat template, which the teacher then scores; set "
                f"data.teacher_prompt=shared"
            )
        if self.env.enabled and self.rollout.stale_samples == "regenerate":
            raise ValueError(
                f"env.name={self.env.name} with rollout.stale_samples=regenerate: a stale trajectory "
                f"would be regenerated as a single-turn response; use rollout.stale_samples=drop"
            )
        ref_layout = (self.reference.tp, self.reference.pp, self.reference.ep)
        student_layout = (self.student.tp, self.student.pp, self.student.ep)
        if ref_layout != student_layout:
            raise ValueError(
                f"reference.tp/pp/ep={ref_layout} differ from student.tp/pp/ep={student_layout}: the reference must "
                f"share the student's layout so their vocab shards and expert groups line up; set "
                f"reference.tp={self.student.tp} reference.pp={self.student.pp} reference.ep={self.student.ep}"
            )
        if self.reference.path:
            ref_dims = check_role_layout("reference", self.reference, world)
            if ref_dims != student_dims:
                raise ValueError(
                    f"reference {self.reference.path} has other sizes than student "
                    f"{self.student.path} ({ref_dims} vs {student_dims}): the reference must be "
                    f"the student's initial checkpoint"
                )
        if (self.trainer.prompts_per_step * self.trainer.samples_per_prompt) % self.trainer.mini_batches_per_step:
            raise ValueError(
                "trainer.prompts_per_step*samples_per_prompt must be a multiple of trainer.mini_batches_per_step"
            )
        self.data.validate()

    def _check_teacher_views(self, teachers: list[TeacherConfig], needs) -> None:
        """A teacher reading a sequence of its own (teacher.context, teacher.tokenizer=own): what it cannot be
        combined with yet, each refused with one line."""
        for i, t in enumerate(teachers):
            key = "teacher" if len(teachers) == 1 and t.name == "teacher" else f"teachers[{i}] ({t.name})"
            if t.tokenizer == "own" and t.path:
                try:
                    tokenizer_dir(t.path)
                except FileNotFoundError:
                    raise ValueError(
                        f"{key}.tokenizer=own but {t.path} has no tokenizer (tokenizer.json / tokenizer_config.json): "
                        f"copy the teacher's tokenizer files there, or set {key}.tokenizer=student"
                    ) from None
            if not (t.own_view or self.data.teacher_prompt == "own"):
                continue
            what = (
                f"{key}.context"
                if t.context
                else f"{key}.tokenizer=own"
                if t.tokenizer == "own"
                else "data.teacher_prompt=own"
            )
            if needs.teacher_logits:
                raise ValueError(
                    f"{what} with loss {self.loss.name!r}: gkd runs the teacher in lockstep on the student's own "
                    f"sequence; use a loss that reads the teacher's scores (opd, stable_opd, lsm)"
                )
            if self.env.enabled and t.tokenizer == "own":
                raise ValueError(
                    f"{what} with env.name={self.env.name}: a trajectory's tool turns are the student's tokens in "
                    f"its chat template, which a teacher of its own tokenizer does not read; set "
                    f"{key}.tokenizer=student (a context of its own works with trajectories)"
                )
            if t.context and "{golden}" in t.context and not self.data.require_golden:
                raise ValueError(
                    f"{key}.context uses {{golden}} with data.require_golden=false: rows without a golden "
                    f"solution would have nothing to fill it with; set data.require_golden=true"
                )

    def _check_cross_tokenizer(self, teachers: list[TeacherConfig], cross: list[str]) -> None:
        """A teacher of another vocabulary: a loss that reads it at the sampled text only, and (in the job) the
        student's layout, so that each rank scores the rows it holds (their length in the teacher's tokens is
        known only where the row is)."""
        for i, t in enumerate(teachers):
            if t.name not in cross:
                continue
            key = "teacher" if len(teachers) == 1 and t.name == "teacher" else f"teachers[{i}] ({t.name})"
            check_cross_tokenizer(self.loss.name, self.loss.config)
            layout, student = (t.tp, t.pp, t.ep), (self.student.tp, self.student.pp, self.student.ep)
            if t.in_job and layout != student:
                raise ValueError(
                    f"{key} has another tokenizer (cross-tokenizer mode) and tp/pp/ep={layout}, the student "
                    f"{student}: an in-job teacher of another vocabulary scores in the student's layout; set "
                    f"{key}.tp={student[0]} {key}.pp={student[1]} {key}.ep={student[2]}, or, for a teacher that "
                    f"needs its own layout, serve it (`megaopd serve` or SGLang at its own TP) and set "
                    f"{key}.engine=remote {key}.urls=[http://HOST:PORT] (docs/algorithms.md 1.13)"
                )

    def _check_routing(self, teachers: list[TeacherConfig]) -> None:
        """Every data source names one of the teachers (several teachers), or none / the one (one teacher)."""
        names = [t.name for t in teachers]
        for src in self.data.sources:
            if src.teacher and src.teacher not in names:
                raise ValueError(
                    f"data source {src.name!r} routes to teacher {src.teacher!r}, which is not among "
                    f"the teachers {names}: fix data.sources[].teacher"
                )
            if len(teachers) > 1 and not src.teacher:
                raise ValueError(
                    f"data source {src.name!r} names no teacher, and the job has several {names}: "
                    f"set data.sources[].teacher to one of them"
                )
