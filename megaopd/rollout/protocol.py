"""The rollout engine protocol: what the trainer and the evaluator ask of any engine.

Implemented by the embedded engine (HF transformers, in-process), the HTTP client (a `megaopd serve`
server or a real SGLang server), and a pool that spreads requests over several engines. Prompts and
responses are token ids; text is decoded by the caller with the student's tokenizer.

    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(n=4, max_new_tokens=64))
      -> 8 Samples, prompt-major: prompt 0 samples 0..3, then prompt 1 samples 0..3
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Protocol

import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    """Sampling settings, named and defaulted as in SGLang's sampling_params."""

    temperature: float = 1.0
    """Softmax temperature; below 1e-6 means greedy. Log-probs are of softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 means the whole vocabulary."""
    max_new_tokens: int = 128
    """Token budget per response; a response that uses it all finishes with reason "length"."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra ids that end a response (the tokenizer's EOS always does unless ignore_eos)."""
    n: int = 1
    """Samples per prompt."""
    seed: int | None = None
    """Makes sampling deterministic for a given prompt batch (SGLang: sampling_seed)."""
    ignore_eos: bool = False

    def __post_init__(self):
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (all tokens) or a positive count")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be at least 1")


@dataclass
class Sample:
    """One generated response."""

    prompt_ids: list[int]
    output_ids: list[int]
    """Generated ids, including the stop token when the response stopped on one."""
    output_logprobs: list[float]
    """log softmax(logits / temperature) of each output id under the engine's weights (len = len(output_ids))."""
    finish_reason: FinishReason
    weight_version: str | None = None


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
        """Samples `params.n` responses per prompt; returns them prompt-major, in input order."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> None:
        """Loads full (unsharded) HF-named tensors into the engine's model; flushes its cache."""

    def release_memory(self) -> None:
        """Frees weights and KV cache memory while the trainer runs (colocated engines)."""

    def resume_memory(self) -> None:
        """Re-allocates what release_memory freed."""

    def health(self) -> bool:
        """True when the engine answers and can generate."""
