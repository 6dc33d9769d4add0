"""The rollout engine protocol: what the trainer and the evaluator ask of any engine.

Implemented by the embedded engine (HF transformers, in-process), the HTTP client (a `megaopd serve`
server or a real SGLang server), and a pool that spreads requests over several engines. Prompts and
responses are token ids; text is decoded by the caller with the student's tokenizer.

    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(n=4, max_new_tokens=64))
      -> 8 Samples, prompt-major: prompt 0 samples 0..3, then prompt 1 samples 0..3

Seeds: with `params.seed` set, sample j of prompt i draws from its own generator seeded with
derive_seed(seed, first_prompt_index + i, j), so results do not depend on batch composition or on how
a pool split the prompts (a pool passes `first_prompt_index` = the chunk's offset in the full batch).
expand_samples is the one place that turns prompts x n into per-sample requests with these seeds;
the HTTP client, the embedded engine and `megaopd serve` all use it.

Weights: an engine names the weight transports it accepts in `weight_transports` (megaopd.sync picks
one per engine; nothing checks engine classes):
    "in_process"  update_weights(named_tensors) in this process (the embedded engine)
    "dist_group"  SGLang's /init_weights_update_group + /update_weights_from_distributed (HTTP engines)
    "cuda_ipc"    SGLang's /update_weights_from_tensor with CUDA IPC handles (HTTP engines on the
                  trainer's own GPUs: colocated)
and `weight_targets()` lists the engines that receive weights (itself, or a pool's members).
Memory: release_memory(tags) / resume_memory(tags) with tags among megaopd.engine.memory.MEMORY_TAGS;
an engine remembers what it released (`released_tags`) and refuses to resume a tag it never released, as
SGLang does (0.5.23 kills the server when asked to).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from megaopd.engine.rows import FinishReason


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
    """Extra ids that end a response, as the model's EOS ids do (neither with ignore_eos)."""
    n: int = 1
    """Samples per prompt."""
    seed: int | None = None
    """Makes sampling deterministic for a given prompt batch (SGLang: sampling_seed, which SGLang honours only
    with --enable-deterministic-inference; the embedded engine and `megaopd serve` always do)."""
    ignore_eos: bool = False
    """Generate to max_new_tokens: neither EOS nor stop_token_ids end the response (SGLang 0.5.23 ignores both)."""
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
    x = (
        int(seed) * 0x9E3779B97F4A7C15
        + int(prompt_index) * 0xBF58476D1CE4E5B9
        + int(sample_index) * 0x94D049BB133111EB
        + 0x632BE59BD9B4E019
    ) & mask
    for mul in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB):
        x ^= x >> 31
        x = (x * mul) & mask
    x ^= x >> 29
    return x & 0x7FFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class SampleRequest:
    """One sample to generate: which prompt, which of its n samples, and the seed of its generator."""

    prompt_index: int
    """Index of the prompt in the caller's list (not offset by first_prompt_index)."""
    sample_index: int
    prompt_ids: list[int]
    seed: int | None
    """None: the engine draws a fresh random seed."""


def expand_samples(
    prompts: Sequence[Sequence[int]],
    n: int | Sequence[int],
    seed: int | None | Sequence[int | None],
    first_prompt_index: int = 0,
    keep_single_seeds: bool = False,
) -> list[SampleRequest]:
    """Prompt-major per-sample requests: prompt i's samples j = 0..n_i-1, seeded derive_seed(seed_i, first + i, j).

    n, seed: one value for every prompt, or one per prompt (a server request may carry a sampling_params
    list). keep_single_seeds: a prompt with n == 1 keeps its seed as given instead of deriving one: a
    server entry with n == 1 is one sample whose seed the client already derived (so the client's result
    equals the embedded engine's); entries with n > 1 still get a distinct seed per prompt and sample.
    """
    ns = [n] * len(prompts) if isinstance(n, int) else list(n)
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
    if len(ns) != len(prompts) or len(seeds) != len(prompts):
        raise ValueError(f"expand_samples: {len(prompts)} prompts but {len(ns)} n values and {len(seeds)} seeds")
    out = []
    for i, (prompt, n_i, s_i) in enumerate(zip(prompts, ns, seeds)):
        for j in range(n_i):
            if s_i is None or (keep_single_seeds and n_i == 1):
                sample_seed = s_i
            else:
                sample_seed = derive_seed(s_i, first_prompt_index + i, j)
            out.append(SampleRequest(i, j, list(prompt), sample_seed))
    return out


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
    output_mask: list[int] | None = None
    """Trajectories (megaopd.rollout.trajectories): 1 where output_ids[i] is the student's own (the engine
    generated it), 0 where an environment turn put it (its output_logprobs entry is then 0); None: every
    output id was generated (a single-turn response)."""
    trajectory: TrajectoryStats | None = None
    """What happened in a multi-turn trajectory (turns, tool calls, its reward); None for a single turn."""


@dataclass
class TrajectoryStats:
    """One multi-turn trajectory's counts, for the metrics and the reward (megaopd.rollout.trajectories)."""

    turns: int
    """Assistant turns generated."""
    tool_calls: int
    """Tool calls the assistant made (well-formed or not)."""
    tool_errors: int
    """Calls answered with an error observation: malformed, unknown tool, or a tool that failed."""
    truncated_by: str = ""
    """"turns" (rollout.max_turns reached), "tokens" (rollout.max_trajectory_tokens or the last turn's
    max_new_tokens used up) or "" (the environment ended it: a final answer)."""
    reward: float = 0.0
    """The environment's final-answer reward (0 without a final answer)."""
    final_text: str = ""
    """The assistant turn the environment ended the episode on ("" when truncated)."""


class Engine(Protocol):
    weight_transports: tuple[str, ...]
    """Weight transports this engine accepts (see the module docstring), in its order of preference."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, first_prompt_index: int = 0) -> list[Sample]:
        """Samples `params.n` responses per prompt; returns them prompt-major, in input order.

        first_prompt_index: index of prompts[0] in the caller's whole batch (only enters seeds).
        """

    def weight_targets(self) -> list["Engine"]:
        """The engines that receive weights: [self], or a pool's members."""

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Frees memory (tags among MEMORY_TAGS; None = all) while the trainer runs (colocated engines)."""

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocates released memory; raises for a tag that is not released (see released_tags)."""

    @property
    def released_tags(self) -> frozenset[str]:
        """Tags released and not resumed since."""

    def health(self) -> bool:
        """True when the engine answers and can generate."""
