"""The runner's unit of work: a row (one prompt and its own sampling settings) in, its tokens out.

A row is one of a prompt's n samples. megaopd.rollout.embedded.row_request builds rows from the protocol's
SamplingParams for both callers (the trainer's in-process engine and `megaopd serve`), so the stop rule is
written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]
"""SGLang's finish reasons: "stop" on EOS or a stop id (kept in output_ids), "length" when max_new_tokens
is used up, "abort" when a server aborted the row."""


@dataclass
class RowRequest:
    """One sequence to generate: a prompt and its own sampling settings (one of a prompt's n samples)."""

    prompt_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_ids: frozenset[int] = frozenset()
    """Ids that finish the row: EOS and stop_token_ids, none with ignore_eos (the caller builds this set)."""
    seed: int | None = None
    """Seed of this row's generator; None draws a fresh random seed."""


@dataclass
class RowResult:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """log softmax(logits / temperature) of each output id, before top-k / top-p / min-p filtering."""
    finish_reason: FinishReason = "length"
    matched: int | None = None
    """The stop id that ended the row (finish_reason "stop")."""
    weight_version: str | None = None


@dataclass
class PromptScores:
    """ModelRunner.prompt_scores, temperature 1: about the prompt's tokens from `first` on."""

    logprobs: list[float]
    """Entry j: log p(token first + j | tokens before it); len(prompt) - first entries."""
    top_ids: list[list[int]] | None = None
    """Entry j: the top-k ids of the distribution that predicts token first + j, by decreasing probability;
    one entry more than logprobs: the last is the distribution after the prompt (the next token's)."""
    top_logprobs: list[list[float]] | None = None
    at_ids_logprobs: list[list[float]] | None = None
    """Log-probs at the caller's fixed ids (SGLang's token_ids_logprob), in their order; rows as top_ids."""
