"""The config section of `megaopd plan`."""
from __future__ import annotations

from dataclasses import dataclass


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
