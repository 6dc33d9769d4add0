"""`megaopd config CONFIG [key=value ...]` and `megaopd plan CONFIG [key=value ...]`.

    megaopd config examples/paper/stable_opd_7b.yaml student.path=DIR ...   the resolved config as YAML
    megaopd plan   examples/paper/stable_opd_7b.yaml student.path=DIR ...   per-GPU memory table; exit 0
                                                                           when it fits, 1 when not

Both load and validate the config exactly as `megaopd train` does (same presets, same overrides, same
checks of the model and data paths), so what they print is what the job runs. Neither imports megatron.
"""
from __future__ import annotations

import sys

from megaopd.config import ConfigError, load_config, to_yaml
from megaopd.config.schema import MegaOPDConfig


def _load(command: str, argv: list[str]) -> MegaOPDConfig | int:
    if not argv or argv[0] in ("-h", "--help") or "=" in argv[0]:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return load_config(MegaOPDConfig, argv[0], argv[1:])
    except ConfigError as e:
        print(f"megaopd {command}: {e}", file=sys.stderr)
        return 2


def config_main(argv: list[str] | None = None) -> int:
    cfg = _load("config", list(sys.argv[1:] if argv is None else argv))
    if isinstance(cfg, int):
        return cfg
    sys.stdout.write(to_yaml(cfg))
    return 0


def plan_for(cfg: MegaOPDConfig):
    """The Plan of a loaded config (reads the models' config.json files)."""
    from megaopd.models.config import find_hf_config
    from megaopd.config.plan import RoleLayout, build_plan, packed_micro_batch_tokens
    from megaopd.losses import build_loss_from
    from megaopd.models.hf_config import read_hf_config

    needs = build_loss_from(cfg.loss).needs

    def role(name, section, path=None):
        hf = read_hf_config(find_hf_config(path or section.path))
        return RoleLayout(name, hf, section.tp, section.pp, section.dtype, section.recompute,
                          section.sequence_parallel, section.offload_between_uses and name != "student", section.ep)

    student = role("student", cfg.student)
    reference = role("reference", cfg.reference, cfg.reference.path or cfg.student.path) if needs.reference else None
    teacher = role("teacher", cfg.teacher) if cfg.teacher.path else None
    seq = cfg.plan.max_tokens or cfg.data.max_prompt_len + max(
        cfg.rollout.max_new_tokens if needs.on_policy else 0, cfg.data.max_golden_len if needs.golden else 0)
    # Packed micro-batches (the default) hold max_tokens_per_micro_batch tokens whatever micro_batch_size is;
    # a GRPO group is packed whole (rewards), so a group longer than the budget is one micro-batch.
    group = cfg.trainer.samples_per_prompt if needs.rewards else 1
    packed = packed_micro_batch_tokens(cfg.trainer.max_tokens_per_micro_batch, seq, group) \
        if cfg.trainer.pack_sequences else 0
    return build_plan(student, reference, teacher, world_size=cfg.run.world_size,
                      micro_batch_rows=cfg.trainer.micro_batch_size, seq_len=seq, packed_tokens=packed,
                      use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
                      colocated=cfg.rollout.colocated and cfg.rollout.engine == "remote",
                      gpu_memory_gb=cfg.plan.gpu_memory_gb, engine_memory_fraction=cfg.plan.engine_memory_fraction,
                      engine_released_gb=cfg.plan.engine_released_gb, reserved_gb=cfg.plan.reserved_gb,
                      flash_attention=cfg.plan.attention == "flash")


def plan_main(argv: list[str] | None = None) -> int:
    from megaopd.config.plan import explain_overflow, format_plan

    cfg = _load("plan", list(sys.argv[1:] if argv is None else argv))
    if isinstance(cfg, int):
        return cfg
    plan = plan_for(cfg)
    print(format_plan(plan))
    if plan.fits():
        print(f"fits: peak {max(plan.total(p) for p in plan.phases) / 1e9:.1f} GB ({plan.peak_phase()}) of "
              f"{plan.gpu_bytes / 1e9:g} GB per GPU")
        return 0
    print(f"megaopd plan: {explain_overflow(plan)}", file=sys.stderr)
    return 1
