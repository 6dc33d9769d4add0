"""env: the job config's section of the multi-turn environment (megaopd.envs). Without one (name "") every
row is a single-turn prompt -> response, as before."""

from __future__ import annotations

from dataclasses import dataclass

ENVIRONMENTS = ("", "calculator")


@dataclass
class EnvConfig:
    """Which environment answers the student's turns, and its limits."""

    name: str = ""
    """"" (single-turn rows: no environment) | calculator (arithmetic word problems: a `calculator` tool in
    the Qwen <tool_call> format, and the math-verify final-answer check that ends the episode)."""
    max_expression_chars: int = 200
    """calculator: a longer expression is an error observation (not evaluated)."""
    max_result_digits: int = 60
    """calculator: a result (or an intermediate power) with more digits is an error observation: a tool call
    must never stall the rollout on a huge integer."""

    def __post_init__(self):
        if self.name not in ENVIRONMENTS:
            raise ValueError(
                f"env.name={self.name!r}: choose one of {', '.join(repr(n) for n in ENVIRONMENTS)} "
                f'("" = single-turn rows), or write your own environment (docs/environments.md)'
            )
        if self.max_expression_chars < 1 or self.max_result_digits < 1:
            raise ValueError("env.max_expression_chars and env.max_result_digits must be at least 1")

    @property
    def enabled(self) -> bool:
        return bool(self.name)
