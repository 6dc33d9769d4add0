"""megaopd.envs: environments for multi-turn rollouts (docs/environments.md).

base.py        the Environment protocol, StepResult, the Qwen <tool_call> parser, error observations
calculator.py  safe arithmetic (parsed, never eval'd)
math_tools.py  CalculatorEnv: the calculator tool + the math-verify final-answer check
config.py      EnvConfig, the job config's `env` section

env = build_environment(cfg.env); env.reset(example); env.step(assistant_text) -> StepResult
"""

from __future__ import annotations

from megaopd.envs.base import Environment, StepResult, ToolCall, error_observation, parse_tool_calls
from megaopd.envs.config import EnvConfig


def build_environment(cfg: EnvConfig) -> Environment:
    """A fresh environment for one trajectory (env.name must be set)."""
    if cfg.name == "calculator":
        from megaopd.envs.math_tools import CalculatorEnv

        return CalculatorEnv(cfg)
    raise ValueError(f"env.name={cfg.name!r} has no environment to build; set env.name=calculator")


__all__ = [
    "EnvConfig",
    "Environment",
    "StepResult",
    "ToolCall",
    "build_environment",
    "error_observation",
    "parse_tool_calls",
]
