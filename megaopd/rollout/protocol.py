"""The rollout engine protocol: what the trainer and the evaluator ask of any engine.

Implemented by the embedded engine (HF transformers, in-process), the HTTP client (a `megaopd serve`
server or a real SGLang server), and a pool that spreads requests over several engines. Prompts and
responses are token ids; text is decoded by the caller with the student's tokenizer.

    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(n=4, max_new_tokens=64))
      -> 8 Samples, prompt-major: prompt 0 samples 0..3, then prompt 1 samples 0..3

Seeds: with `params.seed` set, sample j of prompt i draws from its own generator seeded with
derive_seed(seed, first_prompt_index + i, j), so results do not depend on batch composition or on how
a pool split the prompts (a pool passes `first_prompt_index` = the chunk's offset in the full batch).
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
    """Keep generating past EOS (stop_token_ids still stop)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's; 0 disables."""

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
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]


def derive_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one (prompt, sample) pair: a splitmix64-style hash of the three integers.

    Hashing (rather than seed + index) keeps neighbouring seeds from giving overlapping streams.
    """
    mask = (1 << 64) - 1
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(prompt_index) * 0xBF58476D1CE4E5B9
         + int(sample_index) * 0x94D049BB133111EB + 0x632BE59BD9B4E019) & mask
    for mul in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB):
        x ^= x >> 31
        x = (x * mul) & mask
    x ^= x >> 29
    return x & 0x7FFF_FFFF_FFFF_FFFF


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
    def generate(self, prompts: list[list[int]], params: SamplingParams, first_prompt_index: int = 0) -> list[Sample]:
        """Samples `params.n` responses per prompt; returns them prompt-major, in input order.

        first_prompt_index: index of prompts[0] in the caller's whole batch (only enters seeds).
        """

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> None:
        """Loads full (unsharded) HF-named tensors into the engine's model; flushes its cache."""

    def release_memory(self) -> None:
        """Frees weights and KV cache memory while the trainer runs (colocated engines)."""

    def resume_memory(self) -> None:
        """Re-allocates what release_memory freed."""

    def health(self) -> bool:
        """True when the engine answers and can generate."""
