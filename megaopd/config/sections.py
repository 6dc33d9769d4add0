"""Config sections of the step loop's use of the rollout engines, the metrics and validation."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from megaopd.metrics import CollapseConfig, RepetitionConfig


@dataclass
class RolloutConfig:
    """How rollouts are generated: which engines, which sampling."""

    engine: str = "embedded"
    """embedded (in-process HF engine on rank 0) | remote (megaopd serve or SGLang servers at `urls`)."""
    urls: List[str] = field(default_factory=list)
    """http://host:port of each remote engine (rollout.engine=remote)."""
    engine_tp: int = 1
    """Tensor-parallel size of each remote engine (its workers all join the weight-update group)."""
    weight_sync_address: str = "127.0.0.1"
    """Address of trainer rank 0 that remote engines connect to for weight updates; set it to this node's
    cluster address when the engines run on other nodes (slurm/ scripts do)."""
    weight_sync_bucket_mb: int = 512
    """Bytes per weight-update bucket (megabytes)."""
    temperature: float = 1.0
    """Sampling temperature; every log-prob of the step (actor, teacher, reference) uses it too."""
    top_p: float = 1.0
    """Nucleus mass (LSM paper: 0.9)."""
    top_k: int = -1
    max_new_tokens: int = 1024
    """Response budget; a response that hits it is truncated (rollout/truncation_rate)."""
    colocated: bool = False
    """Engines share the training GPUs: their memory is released while the actor trains and resumed for
    the weight sync and the next generation (SGLang --enable-memory-saver)."""
    max_batch_size: int = 64
    """Sequences the embedded engine decodes together."""
    deterministic: bool = False
    """SGLang engines reproduce seeded samples: launched with --enable-deterministic-inference
    (megaopd.rollout.sglang_launcher.launch_config; slurm/common.sh with ROLLOUT_DETERMINISTIC=1). Without it
    SGLang ignores sampling_seed. Costs SGLang 25-45% of its rollout throughput and needs a GPU attention
    backend. The embedded engine and `megaopd serve` are reproducible from trainer.seed either way."""
    parity_interval: int = 0
    """Every N steps, compare engine and actor log-probs of a fixed probe set after the sync (0: at start only)."""
    parity_tolerance: float = 1e-3
    """float32 actor: max |engine - actor| log-prob allowed by the parity check before the run stops with an
    error (megaopd/scoring/parity.py says what each statistic means)."""
    parity_mean_tolerance: float = 0.05
    """bf16/fp16 actor: mean |engine - actor| log-prob allowed (a correct bf16 sync: about 0.01-0.03)."""
    parity_p99_tolerance: float = 0.5
    """bf16/fp16 actor: 99th percentile of |engine - actor| allowed (one bf16 logit ulp at |logit| 16-32 is 0.125)."""
    parity_min_correlation: float = 0.9
    """bf16/fp16 actor: least correlation of engine and actor log-probs (a correct sync: 0.99+)."""
    request_timeout_s: float = 600.0

    def __post_init__(self):
        if self.engine not in ("embedded", "remote"):
            raise ValueError(f"rollout.engine={self.engine!r}: choose embedded or remote")
        if self.engine == "remote" and not self.urls:
            raise ValueError("rollout.engine=remote needs rollout.urls=[http://host:port, ...]")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be > 0 (log-probs are of logits/T)")


@dataclass
class MetricsConfig:
    """Training-dynamics metrics (docs/algorithms.md section 2) and the collapse early warning."""

    repetition: RepetitionConfig = field(default_factory=RepetitionConfig)
    """Repetition rate (tail length L, ratio tau) and the repetitive-token n-gram."""
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    """Jump/level thresholds on the rollout truncation and repetition rates."""
    overlap_k: int = 16
    """k of the student/teacher top-k overlap metrics (paper 2604.13016: 16); 0 disables them."""


@dataclass
class ValidationConfig:
    """Validation every trainer.eval_interval steps, with the evaluator's code."""

    path: str = ""
    """Benchmark-format jsonl (id, problem, answer); empty disables validation."""
    max_problems: int = 0
    """Use the first N problems (0 = all)."""
    samples: int = 1
    temperature: float = 0.6
    """Paper 2604.08527 evaluates at 0.6."""
    max_new_tokens: int = 1024


@dataclass
class PlanConfig:
    """Inputs of `megaopd plan` (per-GPU memory of the configured layout) that the rest of the config
    does not say: the GPU, the engines' share, what the model leaves out."""

    gpu_memory_gb: float = 141.0
    """Memory of one GPU in GB (1e9 bytes): 141 for an H200, 80 for an H100."""
    engine_memory_fraction: float = 0.5
    """Colocated engines (rollout.colocated): the share of GPU memory they hold while generating (SGLang
    --mem-fraction-static; slurm/common.sh ENGINE_MEM_FRACTION, 0.5 colocated)."""
    engine_released_gb: float = 3.0
    """What a colocated engine keeps after releasing its weights and KV cache (CUDA context, CUDA graphs)."""
    reserved_gb: float = 5.0
    """The trainer's CUDA context, NCCL buffers and allocator fragmentation, as one flat amount."""
    attention: str = "flash"
    """flash: fused attention (Transformer Engine / flash-attention on GPU) saves no S x S scores; unfused:
    megatron's local attention (CPU, or no TE) saves scores and probabilities."""
    max_tokens: int = 0
    """Tokens per row to plan for; 0: data.max_prompt_len + the longer of rollout.max_new_tokens and (for
    losses that train on golden solutions) data.max_golden_len."""

    def __post_init__(self):
        if self.gpu_memory_gb <= 0:
            raise ValueError(f"plan.gpu_memory_gb={self.gpu_memory_gb} must be positive (141 for an H200)")
        if not 0 <= self.engine_memory_fraction < 1:
            raise ValueError(f"plan.engine_memory_fraction={self.engine_memory_fraction} must be in [0, 1)")
        if self.attention not in ("flash", "unfused"):
            raise ValueError(f"plan.attention={self.attention!r}: choose flash or unfused")
        if self.max_tokens < 0:
            raise ValueError(f"plan.max_tokens={self.max_tokens} must be >= 0 (0: from data and rollout)")
