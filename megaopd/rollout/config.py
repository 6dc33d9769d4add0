"""rollout: the job config's section of the rollout engines (which engines, which sampling, the parity
probe), read by build_engine, the weight sync (weight_sync_*, colocated) and the trainer's parity check."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import List

from megaopd.models.config import MODEL_DTYPES

ROLLOUT_MODES = ("sync", "one_step_off", "async")
STALE_SAMPLES = ("drop", "regenerate")
SYNC_PAUSES = ("in_place", "retract")
LORA_SYNCS = ("auto", "adapter", "merged")
ADAPTER_SYNC, MERGED_SYNC = "adapter", "merged"


class RolloutEngine(StrEnum):
    """Which engines generate (rollout.engine), parsed once by RolloutConfig. The job asks a kind's properties,
    never its name; rollout/build.py maps each kind to its builder (docs/extending.md)."""

    EMBEDDED = "embedded"
    REMOTE = "remote"

    @property
    def in_trainer(self) -> bool:
        """The engine lives in trainer rank 0's process, on its device: its memory counts in that rank's
        `megaopd plan`, it generates one batch per call between steps (no overlap, no streamed parts) and takes
        the weights in process. Else served: its servers at rollout.urls (megaopd serve or SGLang)."""
        return self is RolloutEngine.EMBEDDED


@dataclass
class RolloutConfig:
    """How rollouts are generated: which engines, which sampling."""

    engine: str = RolloutEngine.EMBEDDED
    """A RolloutEngine (parsed from its name in __post_init__): embedded (in-process HF engine on rank 0) |
    remote (megaopd serve or SGLang servers at `urls`)."""
    urls: List[str] = field(default_factory=list)
    """http://host:port of each remote engine (rollout.engine=remote)."""
    engine_tp: int = 1
    """Tensor-parallel size of each remote engine (its workers all join the weight-update group)."""
    api_key_env: str = "MEGAOPD_API_KEY"
    """rollout.engine=remote: the environment variable holding the engines' API key (SGLang / `megaopd serve`
    --api-key), sent as `Authorization: Bearer <key>` on every request; unset or empty variable, or "": no
    key. The key itself never goes in a config (config.yaml is copied into the run folder)."""
    weight_sync_address: str = "127.0.0.1"
    """Address of trainer rank 0 that remote engines connect to for weight updates; set it to this node's
    cluster address when the engines run on other nodes (slurm/ scripts do)."""
    weight_sync_bucket_mb: int = 512
    """Bytes per weight-update bucket (megabytes)."""
    lora_sync: str = "auto"
    """A LoRA student's weight sync (student.lora on; set without it, refused): adapter sends the adapter tensors
    alone (r (in + out) numbers per adapted projection; the engine merges W_base + (alpha / r) B A in float32 from
    the base it keeps, which the first sync of a run sends whole), merged sends every weight with the adapters
    merged in (float32 math), for engines without LoRA. auto: adapter for the embedded engine and for `megaopd
    serve` (the adapters through its /load_lora_adapter), merged for SGLang 0.5.23 (its LoRA routes need a GPU on
    this build, docs/engines.md); remote engines are told apart at the first sync (GET /server_info), and
    adapter with an SGLang engine is refused there, naming rollout.lora_sync=merged."""
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
    engine_dtype: str = "auto"
    """The embedded engine's compute dtype: auto (the student's, student.dtype: the engine samples from the
    distribution the actor scores, and a bf16 engine reads half the bytes of a float32 one per token), float32,
    bfloat16 or float16. Remote engines choose their own (SGLang --dtype)."""
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
    """Longest one generate call of the remote pool may take, and the weight sync's wait for one bucket (an
    engine that answers nothing is caught sooner: stall_timeout_s)."""
    stall_timeout_s: float = 30.0
    """Longest time without progress of an engine (rollout.urls, served teachers' urls, the weight sync's
    requests) while the trainer waits on it, probed every stall_timeout_s / 3 (at most every 5 s) while a
    request is outstanding. For a /generate, progress is an engine that says it can generate (GET /ready:
    200; a server paused by another process answers 503 and is named as paused, with the fix); for other
    requests any answer to GET /health counts, a 503 too. The trainer's own pause (mode async) is not
    counted. Then the wait ends with one error naming the engine (rollout.urls[i] and its URL), not retried;
    a pool moves the engine's prompts to the others. A slow engine that can generate is never stalled:
    request_timeout_s bounds that. 0: no stall clock. Independent of this, a preemption signal
    (SIGTERM/SIGUSR1) ends every wait on the engines within a fraction of a second (docs/engines.md "Stalled
    engines and preemption")."""
    mode: str = "sync"
    """sync: generate, then train on it, then sync weights. one_step_off: the engines generate step k+1's
    batch (under the weights of step k) while the trainer trains on step k's. async: up to max_staleness
    batches generate ahead, and weight updates pause in-flight requests (rollout.sync_pause) so a response
    cut by a sync continues under the new weights (a partial rollout). Overlap needs engines on their own
    devices or servers (rollout.engine=remote, colocated=false); docs/algorithms.md "Overlapped rollouts"."""
    max_staleness: int = 1
    """Most weight versions a sample may lag the weights it trains (its oldest token's version); 1 for
    one_step_off, which never exceeds it. async: a sample older than this is handled by stale_samples."""
    stale_samples: str = "drop"
    """async: what happens to a sample older than max_staleness: drop (left out of the loss, counted in
    pipeline/dropped) or regenerate (generated again under the current weights, before the step)."""
    sync_pause: str = "in_place"
    """async: how in-flight requests are held while weights load (SGLang's /pause_generation): in_place keeps
    their KV cache (tokens after the update attend to a cache computed by the old weights), retract
    re-prefills them under the new weights."""
    stream_parts: int = 1
    """Score a batch while it generates: the batch goes to the engines as this many concurrent requests
    (contiguous groups of prompts, each keeping its prompts' seeds, so the samples are the ones a single
    request draws) and each group's responses are scored as soon as the group returns, instead of after the
    whole batch: by served teachers (from rank 0's thread, every mode) and, in rollout.mode sync, by the
    actor's pass and the in-job teachers' too (megaopd.trainer.rollout_stage; a teacher scoring at the student's
    top-k waits for the actor's whole pass). 1: one request, scoring after it. Needs rollout.engine=remote;
    single-turn rollouts (multi-turn ones score after the batch)."""
    max_turns: int = 8
    """Multi-turn rollouts (env.name set): assistant turns per trajectory; a trajectory that reaches it
    without a final answer is truncated (traj/truncated_turns_rate)."""
    max_trajectory_tokens: int = 2048
    """Multi-turn rollouts: tokens after the prompt (the student's and the environment's); each turn's budget
    is min(max_new_tokens, what is left), and a trajectory that runs out is truncated
    (traj/truncated_tokens_rate)."""

    def __post_init__(self):
        if self.engine not in tuple(RolloutEngine):
            raise ValueError(f"rollout.engine={self.engine!r}: choose embedded or remote")
        self.engine = RolloutEngine(self.engine)
        if not self.engine.in_trainer and not self.urls:
            raise ValueError("rollout.engine=remote needs rollout.urls=[http://host:port, ...]")
        check_env_name("rollout.api_key_env", self.api_key_env)
        if self.max_turns < 1 or self.max_trajectory_tokens < 1:
            raise ValueError(
                f"rollout.max_turns={self.max_turns} and rollout.max_trajectory_tokens="
                f"{self.max_trajectory_tokens} must be at least 1"
            )
        if self.stream_parts < 1 or (self.stream_parts > 1 and self.engine.in_trainer):
            raise ValueError(
                f"rollout.stream_parts={self.stream_parts}: must be >= 1, and > 1 needs rollout.engine="
                "remote (the embedded engine generates a batch in one call, in the trainer's process)"
            )
        if self.engine_dtype not in ("auto", *MODEL_DTYPES):
            raise ValueError(f"rollout.engine_dtype={self.engine_dtype!r}: choose auto, {', '.join(MODEL_DTYPES)}")
        if self.stall_timeout_s < 0:
            raise ValueError(
                f"rollout.stall_timeout_s={self.stall_timeout_s} must be >= 0 (seconds an engine may "
                "answer nothing before the wait fails; 0 turns the stall clock off)"
            )
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"rollout.temperature={self.temperature} must be a finite number > 0 (log-probs are of logits/T)"
            )
        if self.lora_sync not in LORA_SYNCS:
            raise ValueError(f"rollout.lora_sync={self.lora_sync!r}: choose {', '.join(LORA_SYNCS)}")
        check_sampling(self)
        check_overlap(self)

    def resolve_lora_sync(self, lora_enabled: bool) -> None:
        """lora_sync as the job runs it (the config's loader calls it once, with student.lora.enabled): auto
        becomes adapter for the embedded engine; remote engines keep auto, which the weight sync resolves at its
        first push from what the engines take (megaopd serve: adapter, SGLang: merged); a LoRA-less student keeps
        auto (its syncs send every weight) and refuses an explicit setting."""
        if not lora_enabled:
            if self.lora_sync != "auto":
                raise ValueError(
                    f"rollout.lora_sync={self.lora_sync} needs student.lora.enabled=true: drop rollout.lora_sync "
                    "(a student without adapters always sends every weight)"
                )
            return
        if self.lora_sync == "auto" and self.engine.in_trainer:
            self.lora_sync = ADAPTER_SYNC

    @property
    def sends_adapters(self) -> bool:
        """The weight sync sends the LoRA adapters alone (after the base, once)."""
        return self.lora_sync == ADAPTER_SYNC


def check_env_name(key: str, name: str) -> None:
    """ValueError unless `name` is "" or an environment variable's name (a key pasted here instead of a
    name would end up in config.yaml)."""
    if name and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(
            f"{key}={name!r} must name an environment variable (e.g. MEGAOPD_API_KEY) that holds the "
            "key, not the key itself; or be empty for no key"
        )


def check_sampling(r: RolloutConfig) -> None:
    """The sampling and engine settings an engine would only refuse at the first request, after the models
    load (each value the engines and SGLang accept; NaN is never one)."""
    if not (math.isfinite(r.top_p) and 0.0 < r.top_p <= 1.0):
        raise ValueError(f"rollout.top_p={r.top_p} must be in (0, 1] (1.0: the whole distribution)")
    if r.top_k == 0 or r.top_k < -1:
        raise ValueError(f"rollout.top_k={r.top_k} must be -1 (all tokens) or a positive count")
    for key in ("max_new_tokens", "max_batch_size", "engine_tp", "weight_sync_bucket_mb"):
        if getattr(r, key) < 1:
            raise ValueError(f"rollout.{key}={getattr(r, key)} must be at least 1")
    if not (math.isfinite(r.request_timeout_s) and r.request_timeout_s > 0):
        raise ValueError(f"rollout.request_timeout_s={r.request_timeout_s} must be a finite number of seconds > 0")
    if r.parity_interval < 0:
        raise ValueError(f"rollout.parity_interval={r.parity_interval} must be >= 0 (0: the probe at start only)")
    for key in ("parity_tolerance", "parity_mean_tolerance", "parity_p99_tolerance"):
        if not (math.isfinite(getattr(r, key)) and getattr(r, key) > 0):
            raise ValueError(f"rollout.{key}={getattr(r, key)} must be a finite number > 0")
    if not (-1.0 <= r.parity_min_correlation <= 1.0):
        raise ValueError(f"rollout.parity_min_correlation={r.parity_min_correlation} must be in [-1, 1]")


def check_overlap(r: RolloutConfig) -> None:
    """rollout.mode and its keys, with the reason when this engine layout cannot overlap."""
    for key, value, choices in (
        ("mode", r.mode, ROLLOUT_MODES),
        ("stale_samples", r.stale_samples, STALE_SAMPLES),
        ("sync_pause", r.sync_pause, SYNC_PAUSES),
    ):
        if value not in choices:
            raise ValueError(f"rollout.{key}={value!r}: choose one of {', '.join(choices)}")
    if r.max_staleness < 1:
        raise ValueError(f"rollout.max_staleness={r.max_staleness} must be >= 1 (weight versions a sample may lag)")
    if r.mode == "sync":
        return
    if r.engine.in_trainer:
        raise ValueError(
            f"rollout.mode={r.mode} needs engines beside the trainer, not in it: the embedded engine "
            "runs in trainer rank 0's process and would share its cores/GPU with training, so nothing "
            "overlaps; use rollout.engine=remote (megaopd serve or SGLang) or rollout.mode=sync"
        )
    if r.colocated:
        raise ValueError(
            f"rollout.mode={r.mode} with rollout.colocated=true: colocated engines release their "
            "memory while the actor trains on the same GPUs, so they cannot generate meanwhile; "
            "use rollout.mode=sync, or engines on their own GPUs (colocated=false)"
        )
    if r.mode == "one_step_off" and r.max_staleness != 1:
        raise ValueError(
            f"rollout.mode=one_step_off lags exactly one weight version; rollout.max_staleness="
            f"{r.max_staleness} applies to async: use mode=async or max_staleness=1"
        )
