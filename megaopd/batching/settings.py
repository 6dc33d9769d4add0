"""BatchingSettings: how a step's rows become the training step's micro-batches, from the trainer's settings and
what the trained model can take. The trainer builds it once; nothing in batching reads a config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Packing:
    """How one rank's rows are packed into micro-batches: the packed part of BatchingSettings."""

    max_tokens: int
    """Tokens per packed micro-batch at most (a unit longer than that gets one of its own)."""
    pad_id: int
    """Token id of padding positions."""
    uniform: bool = False
    """Pad every packed micro-batch to the largest (PP > 1: megatron's pipeline buffers are fixed-size)."""
    multiple: int = 1
    """Packed lengths are multiples of it (sequence parallelism splits a row's tokens over TP)."""


@dataclass(frozen=True)
class BatchingSettings:
    """The training step's batching: the trainer's settings and the trained model's limits ("settings", not
    "plan": `megaopd plan` is the memory plan)."""

    prompts_per_step: int
    """Prompts per step, which is also the golden rows per step (trainer.prompts_per_step)."""
    mini_batches: int
    """Optimizer steps per rollout batch (trainer.mini_batches_per_step): the rows are cut into that many."""
    micro_batch_size: int
    """Rows per padded micro-batch (trainer.micro_batch_size)."""
    pad_id: int
    """Token id of padding positions and rows."""
    max_tokens: int | None = None
    """Packed micro-batches of at most this many tokens (trainer.max_tokens_per_micro_batch, when
    trainer.pack_sequences is on and the model takes packed rows); None: padded rows."""
    uniform: bool = False
    """Pad every packed micro-batch to the largest (PP > 1: megatron's pipeline buffers are fixed-size)."""
    multiple: int = 1
    """Packed lengths are multiples of it (sequence parallelism splits a row's tokens over TP)."""

    def __post_init__(self):
        if min(self.prompts_per_step, self.mini_batches, self.micro_batch_size, self.multiple) < 1:
            raise ValueError(f"{self}: sizes must be at least 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 1 (None: padded rows)")

    @property
    def packed(self) -> bool:
        return self.max_tokens is not None

    @property
    def packing(self) -> Packing:
        """The packed settings (packed settings only)."""
        if self.max_tokens is None:
            raise ValueError("padded settings have no packing (max_tokens is None)")
        return Packing(max_tokens=self.max_tokens, pad_id=self.pad_id, uniform=self.uniform, multiple=self.multiple)
