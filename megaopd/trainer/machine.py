"""Settings this machine cannot train with, named before the ranks start.

A cluster preset (examples/paper, examples/qwen3) run on a machine without a GPU failed deep inside megatron,
after the imports and the models' builds, with a traceback about `torch.cuda.FloatTensor` or "sequence
parallel not supported by torch LayerNorm". `megaopd train` now says which key and what to set instead,
before it launches anything:

    problems = gpu_only_settings(cfg, cuda=torch.cuda.is_available(), transformer_engine=have_te())
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: config composes every package's section
    from megaopd.config.schema import MegaOPDConfig


def have_transformer_engine() -> bool:
    """Importable without importing it (the launcher stays light); megaopd.models.compat makes the same test."""
    return importlib.util.find_spec("transformer_engine") is not None


def gpu_only_settings(cfg: MegaOPDConfig, cuda: bool, transformer_engine: bool) -> list[str]:
    """One line per setting that cannot run here, each naming the key and the fix; [] when all can."""
    problems = []
    if not cuda and cfg.student.dtype != "float32":
        # Megatron's mixed-precision optimizer wraps only CUDA parameters (frozen models may stay bf16).
        problems.append(
            f"student.dtype={cfg.student.dtype} trains only on a GPU (megatron's mixed-precision "
            "optimizer takes CUDA tensors): set student.dtype=float32 on this machine"
        )
    if not cuda and cfg.optimizer.use_distributed_optimizer:
        problems.append(
            "optimizer.use_distributed_optimizer=true needs a GPU (megatron-core's distributed "
            "optimizer takes CUDA tensors): set optimizer.use_distributed_optimizer=false on this machine"
        )
    # Sequence parallelism splits the norms' inputs over TP ranks: only Transformer Engine's norms take that
    # (megaopd.models.compat builds TE layers only with a GPU and TE; megatron's local norms refuse it).
    if not (cuda and transformer_engine):
        why = "this machine has no GPU" if not cuda else "Transformer Engine is not installed"
        sections = [("student", cfg.student)] + [
            ("teacher" if len(cfg.teachers) == 1 else f"teachers[{i}]", t)
            for i, t in enumerate(cfg.teachers)
            if t.in_job
        ]
        for key, section in sections:
            if section.sequence_parallel:
                problems.append(
                    f"{key}.sequence_parallel=true needs Transformer Engine layers on a GPU ({why}; "
                    f"megatron's local norms refuse it): set {key}.sequence_parallel=false"
                )
    return problems
