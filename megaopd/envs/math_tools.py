"""The calculator environment: arithmetic word problems with a `calculator` tool. A turn with tool calls
gets their results (or error observations); a turn without one is the final answer, checked by the
math-verify reward the single-turn runs use (its last \\boxed{} against the row's gold answer), and ends
the episode."""

from __future__ import annotations

from megaopd.envs.base import StepResult, error_observation, parse_tool_calls
from megaopd.envs.calculator import ToolError, calculate
from megaopd.envs.config import EnvConfig
from megaopd.metrics.reward import math_verify_reward

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression (numbers, + - * / // % ** and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
}


class CalculatorEnv:
    """env.name=calculator (see the module docstring)."""

    tools = [CALCULATOR_TOOL]

    def __init__(self, cfg: EnvConfig):
        self.cfg = cfg
        self.answer = ""

    def reset(self, example) -> None:
        self.answer = example.answer

    def step(self, assistant_text: str) -> StepResult:
        calls = parse_tool_calls(assistant_text)
        if not calls:
            return StepResult(done=True, reward=math_verify_reward(assistant_text, self.answer))
        observations, errors = [], 0
        for call in calls:
            try:
                observations.append(self._answer(call))
            except ToolError as e:
                observations.append(error_observation(str(e)))
                errors += 1
        return StepResult(done=False, observations=observations, tool_calls=len(calls), tool_errors=errors)

    def _answer(self, call) -> str:
        if call.error:
            raise ToolError(call.error)
        if call.name != "calculator":
            raise ToolError(f"unknown tool {call.name!r}; the tools are: calculator")
        unknown = set(call.arguments) - {"expression"}
        if unknown or "expression" not in call.arguments:
            raise ToolError('calculator takes one argument: {"expression": "<arithmetic>"}')
        return calculate(call.arguments["expression"], self.cfg.max_expression_chars, self.cfg.max_result_digits)
