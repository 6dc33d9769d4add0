"""trainer: the job config's sections of the step loop: optimizer and schedule, step counts and intervals,
logging, the run folder, validation. Only dataclasses (no torch, no megatron): `megaopd config` loads them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class OptimizerConfig:
    """Adam(W) with linear warmup then a constant or cosine schedule (megatron's optimizer)."""

    lr: float = 1e-6
    """Peak learning rate (Stable-OPD paper: 1e-6 for 1.5B/7B students)."""
    min_lr: float = 0.0
    """Learning rate at the end of a cosine decay."""
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup to lr: optimizer step k (from 0) of the warmup trains at
    lr * (k + 1) / warmup_steps, so the first step already trains (warmup_steps=1: at lr) and the last warmup
    step at lr. train/lr logs the lr the step used."""
    decay_style: str = "constant"
    """constant | cosine | linear (after warmup, over trainer.max_steps optimizer steps)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (GPU only in megatron-core 0.16)."""

    def __post_init__(self):
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"optimizer.lr={self.lr} must be positive (a finite number > 0)")
        if not (math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"optimizer.min_lr={self.min_lr} must be in [0, optimizer.lr={self.lr}]")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"optimizer.{key}={getattr(self, key)} must be in [0, 1)")
        if not (math.isfinite(self.adam_eps) and self.adam_eps > 0):
            raise ValueError(f"optimizer.adam_eps={self.adam_eps} must be a finite number > 0")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"optimizer.weight_decay={self.weight_decay} must be a finite number >= 0")
        if self.decay_style not in ("constant", "cosine", "linear"):
            raise ValueError(f"optimizer.decay_style={self.decay_style!r}: choose constant, cosine or linear")
        if self.warmup_steps < 0 or not self.clip_grad >= 0 or math.isinf(self.clip_grad):
            raise ValueError("optimizer.warmup_steps and optimizer.clip_grad must be >= 0")


@dataclass
class TrainerConfig:
    """How many steps, how they are cut into micro-batches, and when to save and evaluate."""

    max_steps: int = 100
    """Rollout steps to run (each: generate, score, train, sync)."""
    prompts_per_step: int = 64
    """Prompts per rollout batch, over all data-parallel ranks (paper: 64)."""
    samples_per_prompt: int = 4
    """Responses sampled per prompt (paper: 4)."""
    mini_batches_per_step: int = 1
    """Optimizer steps per rollout batch; 1 is strictly on-policy."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one rank (gradient accumulation over the rest); the padded path
    only (pack_sequences: false) and `megaopd logprobs` / the parity probe."""
    pack_sequences: bool = True
    """Pack several sequences into each micro-batch (THD rows with cu_seqlens: no padding tokens) for the
    scoring passes and the training step, cut by max_tokens_per_micro_batch, with data-parallel shares
    balanced by token count and attention cost. false: every sequence padded to the step's longest and
    micro_batch_size rows per micro-batch (the older path, kept for comparison)."""
    max_tokens_per_micro_batch: int = 16384
    """Token budget of one packed micro-batch on one rank (pack_sequences: true): sequences are packed
    first-fit-decreasing up to it; a longer sequence gets a micro-batch of its own. With PP > 1 every
    micro-batch of a pass is padded to the pass's largest (fixed-size pipeline buffers). Bounds the
    activation and logit memory of a forward ([tokens, vocab / TP] logits in the model's dtype; `megaopd plan`
    counts it)."""
    logits_chunk_tokens: int = 1024
    """The output layer fused with the loss and the scoring passes' ops: the logits of this many tokens exist
    at a time (made from the hidden states and this rank's vocabulary shard of the output weight, used,
    dropped, and made again in backward), never the whole micro-batch's [tokens, vocab / TP] (megaopd.ops.head).
    Costs one more logits matmul per token in backward; saves ~3 logits-sized buffers of the micro-batch
    (`megaopd plan` counts the chunk). 0: the model's own output layer makes the whole logits (the older path,
    kept for comparison)."""
    save_interval: int = 50
    """Checkpoint every N steps (and on SIGTERM/SIGUSR1, and at the end)."""
    eval_interval: int = 25
    """Validation every N steps (and at step 0 and the end); 0 disables it."""
    seed: int = 1234
    skip_nonfinite: bool = False
    """A non-finite loss term or gradient: false (the default) stops the run with one error naming the term,
    the step and the rows (exit non-zero); true skips that optimizer update instead (no weight change, the
    schedule does not advance) and counts it in train/skipped_nonfinite. Costs one all-reduce of a flag per
    optimizer step either way."""

    def __post_init__(self):
        for name in (
            "max_steps",
            "prompts_per_step",
            "samples_per_prompt",
            "mini_batches_per_step",
            "micro_batch_size",
            "save_interval",
            "max_tokens_per_micro_batch",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name}={getattr(self, name)} must be at least 1")
        if self.logits_chunk_tokens < 0:
            raise ValueError(f"trainer.logits_chunk_tokens={self.logits_chunk_tokens} must be >= 0 (0: whole logits)")
        if self.eval_interval < 0:
            raise ValueError(f"trainer.eval_interval={self.eval_interval} must be >= 0 (0 disables)")


@dataclass
class WandbConfig:
    """Weights & Biases beside TensorBoard: step metrics, collapse events, sample tables, evaluation tables."""

    project: str | None = None
    """W&B project; None (the default) logs nothing to W&B."""
    name: str | None = None
    """Run name shown in W&B (default: the run folder's name). A resumed run continues the same W&B run
    (its id is kept in RUN/wandb_run_id)."""
    mode: str = "online"
    """online | offline (writes RUN/wandb/offline-run-*, no network; upload later with `wandb sync`, as
    compute nodes usually have no internet) | disabled."""

    def __post_init__(self):
        if self.mode not in ("online", "offline", "disabled"):
            raise ValueError(f"logging.wandb.mode={self.mode!r}: choose online, offline (no network) or disabled")

    @property
    def enabled(self) -> bool:
        return bool(self.project) and self.mode != "disabled"


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    """Write TensorBoard events to RUN/tb."""
    samples_per_step: int = 4
    """Generations written to RUN/samples/step_N.jsonl each step."""
    progress_bar: str = "auto"
    """auto (when attached to a terminal) | on | off."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases: {project, name, mode}; off unless project is set (pip install 'megaopd[wandb]')."""


@dataclass
class RunConfig:
    dir: str = "runs/default"
    """The run folder: config.yaml, metrics.jsonl, tb/, checkpoints/, samples/, plots/. Resumes if present."""
    world_size: int = 1
    """Ranks of the job; on CPU `megaopd train` starts this many gloo workers itself."""
    start_over: bool = False
    """Start at step 0 in a run folder that has checkpoints: they (and checkpoints/latest) are moved to
    checkpoints/old_<time>/, never deleted, and metrics.jsonl's rows to a side file. Without it a run folder
    with steps always resumes (docs/run_folder.md)."""

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"run.world_size={self.world_size} must be at least 1")


@dataclass
class ValidationConfig:
    """Validation every trainer.eval_interval steps, with the evaluator's code."""

    path: str = ""
    """Benchmark-format jsonl (id, problem, answer); empty disables validation."""
    max_problems: int = 0
    """Use the first N problems (0 = all)."""
    samples: int = 1
    """Responses per problem (accuracy is their mean)."""
    temperature: float = 0.6
    """Paper 2604.08527 evaluates at 0.6; 0 is greedy."""
    max_new_tokens: int = 1024
    """Response budget of a validation generation."""

    def __post_init__(self):
        # Checked here, with or without a path: `megaopd config` refuses what the first validation (after
        # the models load, possibly hours in) would.
        if self.max_problems < 0:
            raise ValueError(f"validation.max_problems={self.max_problems} must be >= 0 (0: every problem)")
        if self.samples < 1:
            raise ValueError(f"validation.samples={self.samples} must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"validation.temperature={self.temperature} must be a finite number >= 0 (0: greedy)")
        if self.max_new_tokens < 1:
            raise ValueError(f"validation.max_new_tokens={self.max_new_tokens} must be at least 1")
