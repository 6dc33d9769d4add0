"""rollout: the job config's section of the rollout engines (which engines, which sampling, the parity
probe), read by build_engine, the weight sync (weight_sync_*, colocated) and the trainer's parity check."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


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
    (megaopd.serving.sglang_launcher.launch_config; slurm/common.sh with ROLLOUT_DETERMINISTIC=1). Without it
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
    max_turns: int = 8
    """Multi-turn rollouts (env.name set): assistant turns per trajectory; a trajectory that reaches it
    without a final answer is truncated (traj/truncated_turns_rate)."""
    max_trajectory_tokens: int = 2048
    """Multi-turn rollouts: tokens after the prompt (the student's and the environment's); each turn's budget
    is min(max_new_tokens, what is left), and a trajectory that runs out is truncated
    (traj/truncated_tokens_rate)."""

    def __post_init__(self):
        if self.engine not in ("embedded", "remote"):
            raise ValueError(f"rollout.engine={self.engine!r}: choose embedded or remote")
        if self.engine == "remote" and not self.urls:
            raise ValueError("rollout.engine=remote needs rollout.urls=[http://host:port, ...]")
        if self.max_turns < 1 or self.max_trajectory_tokens < 1:
            raise ValueError(f"rollout.max_turns={self.max_turns} and rollout.max_trajectory_tokens="
                             f"{self.max_trajectory_tokens} must be at least 1")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be > 0 (log-probs are of logits/T)")
