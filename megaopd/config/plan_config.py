"""The planning sections of the job's config: `plan` (megaopd plan's memory inputs) and `plan.step_time`
(megaopd plan --step-time's rates). Their own module, importing nothing of megaopd, so the schema composes them
while plan.py and step_time.py, which read the whole config, import the schema without a circle."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepTimeConfig:
    """Rates and lengths `megaopd plan --step-time` turns the config's work into seconds with."""

    nodes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """Node counts to tabulate."""
    gpus_per_node: int = 4
    """GPUs per node (the presets' H200 nodes have 4)."""
    peak_tflops: float = 989.0
    """The GPU's dense bf16 peak TFLOP/s, the one the MFUs below are fractions of (H100 and H200: 989, as the
    trainer's perf/mfu_* metrics count it; a bf16 matmul alone reaches ~790 on them)."""
    hbm_tb_s: float = 4.3
    """GPU memory bandwidth in TB/s (~4.3 measured on an H200, ~3.0 on an H100)."""
    train_mfu: float = 0.11
    """Model-FLOPs MFU of the training phase: 0.11 measured (one H100, Qwen2.5-1.5B student and teacher,
    recompute=full, benchmarks/README.md); the target is 0.35."""
    score_mfu: float = 0.15
    """MFU of a forward-only scoring pass (and of prefill, and of a decode step's compute): ~0.15, estimated
    from the same bench's actor pass (0.47 s; its prompt lengths were not recorded)."""
    decode_efficiency: float = 0.5
    """Share of the memory bandwidth a decode step reaches. An estimate for SGLang with CUDA graphs (not
    measured here); the embedded engine measured ~0.01 at 1.5B on an H100 (582 tokens/s), transformers'
    compiled generate ~0.13 (benchmarks/README.md, Rollout)."""
    engine_tp: int = 1
    """GPUs per engine instance (SGLang --tp); instances = engine GPUs / engine_tp."""
    prompt_tokens: int = 256
    """Mean prompt tokens, template included (an estimate for OpenR1-Math prompts)."""
    response_tokens: int = 0
    """Mean response tokens (golden solutions too); 0: half of the longest response, rollout.max_new_tokens or
    (with an environment) rollout.max_trajectory_tokens (an estimate; the first steps'
    rollout/response_length_mean says it)."""
    network_gb_s: float = 25.0
    """GB/s of a weight push from the trainer to engines on other nodes (NCCL broadcast over one
    200 Gb/s link: an estimate)."""
    local_gb_s: float = 100.0
    """GB/s of a weight push to colocated engines on the same GPUs (CUDA IPC handles: an estimate)."""

    def __post_init__(self):
        for name in ("peak_tflops", "hbm_tb_s", "network_gb_s", "local_gb_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"plan.step_time.{name}={getattr(self, name)} must be positive")
        for name in ("train_mfu", "score_mfu", "decode_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"plan.step_time.{name}={getattr(self, name)} must be in (0, 1]")
        if self.gpus_per_node < 1 or self.engine_tp < 1 or not self.nodes or min(self.nodes) < 1:
            raise ValueError("plan.step_time: gpus_per_node, engine_tp and every entry of nodes must be >= 1")


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
    """A margin for what is not itemized (NCCL communicator buffers at many ranks, cuDNN/cuBLAS autotuning
    workspaces), as one flat amount on top of the items."""
    cuda_context_gb: float = 0.6
    """One process's CUDA context with torch's kernels and the cuBLAS workspace (about 0.5-0.6 GB on an H100
    with CUDA 12-13, not measured here; nvidia-smi counts it, torch's allocator does not)."""
    allocator_reserve: float = 0.1
    """torch's caching allocator keeps freed blocks reserved for reuse (nvidia-smi counts them): this fraction
    of each phase's allocated bytes is added (fragmentation between the phases' differently sized tensors)."""
    attention: str = "flash"
    """flash: fused attention (Transformer Engine / flash-attention on GPU) saves no S x S scores; unfused:
    megatron's local attention (CPU, or no TE) saves scores and probabilities."""
    max_tokens: int = 0
    """Tokens per row to plan for, every row; 0: each row's budget (on-policy: data.max_prompt_len +
    rollout.max_new_tokens, or rollout.max_trajectory_tokens with an environment; golden:
    data.max_prompt_len + data.max_golden_len)."""
    device: str = "auto"
    """What the job runs on: cuda (per GPU: the CUDA context, the allocator's reserve, reserved_gb), cpu (per
    rank process, resident memory: cpu_process_gb instead; frozen models are never offloaded, engines keep
    their weights) or auto: cuda when a model is bfloat16/float16 or this machine has a GPU, else cpu (a
    float32 GPU job planned on a machine without one: set plan.device=cuda)."""
    cpu_process_gb: float = 0.75
    """device=cpu: what a rank process holds before and beside its tensors (the interpreter, torch,
    megatron-core, transformers and their libraries' pages, the tokenizer, the data, gloo buffers, the
    heap's free pages): 0.75 GB, measured as the tiny demo's rank RSS (benchmarks/plan_vs_measured.py)."""
    cpu_memory_gb: float = 0.0
    """device=cpu: the machine's memory that all `run.world_size` local ranks share; 0: this machine's."""
    step_time: StepTimeConfig = field(default_factory=StepTimeConfig)
    """Rates of `megaopd plan --step-time` (megaopd/config/step_time.py)."""

    def __post_init__(self):
        if self.gpu_memory_gb <= 0:
            raise ValueError(f"plan.gpu_memory_gb={self.gpu_memory_gb} must be positive (141 for an H200)")
        if not 0 <= self.engine_memory_fraction < 1:
            raise ValueError(f"plan.engine_memory_fraction={self.engine_memory_fraction} must be in [0, 1)")
        if self.attention not in ("flash", "unfused"):
            raise ValueError(f"plan.attention={self.attention!r}: choose flash or unfused")
        if self.max_tokens < 0:
            raise ValueError(f"plan.max_tokens={self.max_tokens} must be >= 0 (0: from data and rollout)")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"plan.device={self.device!r}: choose auto, cuda or cpu")
        if self.cpu_process_gb < 0 or self.cpu_memory_gb < 0:
            raise ValueError(
                f"plan.cpu_process_gb={self.cpu_process_gb} and plan.cpu_memory_gb={self.cpu_memory_gb} must be >= 0"
            )
        if self.cuda_context_gb < 0 or not 0 <= self.allocator_reserve < 1:
            raise ValueError(
                f"plan.cuda_context_gb={self.cuda_context_gb} must be >= 0 and plan.allocator_reserve="
                f"{self.allocator_reserve} in [0, 1)"
            )
