"""`megaopd config CONFIG [key=value ...]` and `megaopd plan CONFIG [key=value ...]`.

    megaopd config examples/paper/stable_opd_7b.yaml student.path=DIR ...   the resolved config as YAML
    megaopd config --strict CONFIG [key=value ...]     ... and exit 2 on anything `megaopd train` refuses at
                                                       start-up, a missing file included (slurm/common.sh)
    megaopd plan   examples/paper/stable_opd_7b.yaml student.path=DIR ...   per-GPU memory table; exit 0
                                                                           when it fits, 1 when not
    megaopd plan --step-time CONFIG [key=value ...]    also the step time of each rollout.mode on
                                                       plan.step_time.nodes nodes (estimates; step_time.py)

Both load and validate the config exactly as `megaopd train` does (same presets, same overrides, same
checks of the model and data paths), so what they print is what the job runs. Neither imports megatron.
A preset whose files are not there yet (a fresh clone: no models, no data) is still shown: one warning line
names the missing files, and the checks that read them are left to `megaopd train`, which refuses until they
exist. `megaopd plan` reads each model's config.json (its sizes): without it, it says which one to fetch.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

from omegaconf import OmegaConf

from megaopd.config import ConfigError, load_config
from megaopd.config.schema import MegaOPDConfig
from megaopd.data.config import REPO_ROOT, resolve_data_files


def missing_inputs(cfg: MegaOPDConfig) -> list[tuple[str, str]]:
    """The (key, path) of each file or folder the config names that is not there: the models, the data
    sources, the validation set."""
    paths = [("student.path", cfg.student.path), ("reference.path", cfg.reference.path)]
    paths += [(f"teachers[{i}].path", t.path) for i, t in enumerate(cfg.teachers) if t.path]
    missing = [(k, p) for k, p in paths if p and not os.path.exists(p)]
    missing += [
        (f"data.sources[{i}].path", s.path) for i, s in enumerate(cfg.data.sources) if not resolve_data_files(s.path)
    ]
    if cfg.validation.path and not os.path.isfile(cfg.validation.path):
        missing.append(("validation.path", cfg.validation.path))
    return missing


def _with_stand_ins(cfg: MegaOPDConfig, missing: list[tuple[str, str]]) -> MegaOPDConfig:
    """A copy of `cfg` whose missing data sources and validation set are the tiny shipped files, so that the
    checks after the file checks (layouts, lengths, losses) still run on a preset whose data is not there yet."""
    probe = copy.deepcopy(cfg)
    keys = {k for k, _ in missing}
    for i, source in enumerate(probe.data.sources):
        if f"data.sources[{i}].path" in keys:
            source.path = os.path.join(REPO_ROOT, "examples", "tiny", "data", "opd.jsonl")
    if "validation.path" in keys:
        probe.validation.path = os.path.join(REPO_ROOT, "examples", "tiny", "data", "val.jsonl")
    return probe


def _load(command: str, argv: list[str], strict: bool = False, need_models: bool = False) -> MegaOPDConfig | int:
    if not argv or argv[0] in ("-h", "--help") or "=" in argv[0]:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        cfg = load_config(MegaOPDConfig, argv[0], argv[1:], validate=False)
        missing = [] if strict else missing_inputs(cfg)
        models = [(k, p) for k, p in missing if not k.startswith(("data.", "validation."))]
        if need_models and models:
            raise ConfigError(
                f"{', '.join(f'{k}={p}' for k, p in models)} not there: the plan reads each model's sizes from "
                f"its config.json; put the models (or only their config.json, e.g. `huggingface-cli download "
                f"Qwen/Qwen2.5-Math-7B config.json --local-dir $MODELS_DIR/Qwen2.5-Math-7B`) there, or point "
                f"the paths at them"
            )
        try:
            _with_stand_ins(cfg, missing).validate() if missing else cfg.validate()
        except (ValueError, FileNotFoundError) as e:
            # Without the models only the checks before the first one that reads them ran; any other refusal is
            # the config's own fault.
            if not any(p in str(e) for _, p in models):
                raise ConfigError(str(e)) from None
        if missing:
            print(
                f"megaopd {command}: warning: not there yet: {', '.join(f'{k}={p}' for k, p in missing)}; the "
                f"checks that read them did not run (`megaopd train` refuses until they exist)",
                file=sys.stderr,
            )
        return cfg
    except ConfigError as e:
        print(f"megaopd {command}: {e}", file=sys.stderr)
        return 2


def display(cfg: MegaOPDConfig) -> dict:
    """What `megaopd config` prints: the config as the job reads it. The `teacher:` shorthand, already folded
    into `teachers`, is left out (it is always empty after loading), and `loss.config` shows every key of the
    loss with its value, defaults included (the run folder's config.yaml keeps what was set)."""
    from megaopd.losses import build_loss_from

    out = OmegaConf.to_container(OmegaConf.structured(cfg))
    out.pop("teacher", None)
    out["loss"]["config"] = dataclasses.asdict(build_loss_from(cfg.loss).config)
    return out


def config_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    strict = "--strict" in argv
    cfg = _load("config", [a for a in argv if a != "--strict"], strict)
    if isinstance(cfg, int):
        return cfg
    sys.stdout.write(OmegaConf.to_yaml(display(cfg)))
    return 0


def plan_main(argv: list[str] | None = None) -> int:
    from megaopd.config.plan import explain_overflow, format_plan, plan_for

    argv = list(sys.argv[1:] if argv is None else argv)
    step_time = "--step-time" in argv
    cfg = _load("plan", [a for a in argv if a != "--step-time"], need_models=True)
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
