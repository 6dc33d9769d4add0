"""`megaopd config CONFIG [key=value ...]` and `megaopd plan CONFIG [key=value ...]`.

    megaopd config examples/paper/stable_opd_7b.yaml student.path=DIR ...   the resolved config as YAML
    megaopd plan   examples/paper/stable_opd_7b.yaml student.path=DIR ...   per-GPU memory table; exit 0
                                                                           when it fits, 1 when not
    megaopd plan --step-time CONFIG [key=value ...]    also the step time of each rollout.mode on
                                                       plan.step_time.nodes nodes (estimates; step_time.py)

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


def plan_main(argv: list[str] | None = None) -> int:
    from megaopd.config.plan import explain_overflow, format_plan, plan_for

    argv = list(sys.argv[1:] if argv is None else argv)
    step_time = "--step-time" in argv
    cfg = _load("plan", [a for a in argv if a != "--step-time"])
    if isinstance(cfg, int):
        return cfg
    plan = plan_for(cfg)
    print(format_plan(plan))
    if step_time:
        from megaopd.config.step_time import format_step_times

        print("\n" + format_step_times(cfg) + "\n")
    if plan.fits():
        print(plan.summary())
        return 0
    print(f"megaopd plan: {explain_overflow(plan)}", file=sys.stderr)
    return 1
