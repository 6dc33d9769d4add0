"""The environment interface the multi-turn rollout loop (megaopd.rollout.trajectories) drives, and the
tool-call format of the Qwen2.5 / Qwen3 chat templates.

    env = build_environment(cfg.env)              # one per trajectory (it keeps the episode's state)
    env.reset(example)                            # a data row (megaopd.data.PromptExample)
    result = env.step(assistant_text)             # the assistant's turn, decoded
    result.done -> result.reward                  # a final answer: the episode ends
    else result.observations                      # tool results, rendered as tool turns by the chat template

An environment sees and returns text; the loop owns the token ids (the student's tokens exactly as the
engine produced them, the observations as the ids the student's chat template renders for tool turns).
A tool call the environment cannot answer (malformed JSON, an unknown tool, a failing tool) is an error
observation the model reads on its next turn, counted in StepResult.tool_errors: never an exception.

Tool calls (Qwen2.5 / Qwen3 templates: tools are passed to apply_chat_template(tools=...)):
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass
class StepResult:
    """What the environment answers to one assistant turn."""

    done: bool
    """The episode is over (a final answer): no observation follows."""
    observations: list[str] = field(default_factory=list)
    """One tool-turn content per tool call, in call order (errors included); empty when done."""
    reward: float = 0.0
    """The final-answer reward (when done)."""
    tool_calls: int = 0
    """Tool calls in this turn, well-formed or not."""
    tool_errors: int = 0
    """Of them, answered with an error observation."""


class Environment(Protocol):
    """One episode's environment. Built per trajectory by build_environment; the loop calls reset once, then
    step after every assistant turn until done (or until rollout.max_turns / max_trajectory_tokens)."""

    tools: list[dict[str, Any]]
    """The tools' JSON schemas (OpenAI function format), passed to the chat template with the prompt."""

    def reset(self, example) -> None:
        """Starts an episode for a data row (its problem and gold answer)."""

    def step(self, assistant_text: str) -> StepResult:
        """The environment's answer to the assistant's turn (its decoded text, special tokens kept)."""


@dataclass
class ToolCall:
    """One parsed tool call, or the error that makes it unanswerable."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    """Why the call is malformed ("" when it parsed)."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call>{json}</tool_call> block of an assistant turn, in order. A block that is not a JSON
    object with a string "name" and an object "arguments", or an opening tag never closed, is a ToolCall
    with `error` set."""
    calls = []
    for m in _BLOCK.finditer(text):
        calls.append(_parse_one(m.group(1).strip()))
    rest = _BLOCK.sub("", text)
    if TOOL_CALL_OPEN in rest:
        calls.append(ToolCall(error=f"a {TOOL_CALL_OPEN} without its {TOOL_CALL_CLOSE}"))
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(error='a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], error="the tool call's arguments are not a JSON object")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error="the tool call's arguments are not a JSON object")
    return ToolCall(obj["name"], args)


def error_observation(message: str) -> str:
    """The text of an error the model reads as the tool's answer."""
    return f"Error: {message}"
