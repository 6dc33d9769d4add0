"""Multi-turn trajectory metrics (megaopd.rollout.trajectories): how the student used its tools.

    trajectory_metrics(turns, tool_calls, tool_errors, truncated_by, student_tokens, response_tokens)

Per trajectory means of turns, tool calls and tool errors; the share of trajectories with at least one
tool call (the tool-call rate); the environment-token share (environment tokens / tokens after the
prompts, over the batch: what the scoring passes pay for but never train on); and truncation split by
cause: rollout.max_turns ("turns") vs the token budgets ("tokens"). Pure functions of Python lists.
"""

from __future__ import annotations

from typing import Sequence


def trajectory_metrics(
    turns: Sequence[int],
    tool_calls: Sequence[int],
    tool_errors: Sequence[int],
    truncated_by: Sequence[str],
    student_tokens: Sequence[int],
    response_tokens: Sequence[int],
    prefix: str = "traj",
) -> dict[str, float]:
    """Keys {prefix}/turns_mean, /tool_calls_mean, /tool_errors_mean, /tool_call_rate, /env_token_share,
    /truncated_turns_rate, /truncated_tokens_rate (all 0 for an empty batch)."""
    n = len(turns)
    if not n == len(tool_calls) == len(tool_errors) == len(truncated_by) == len(student_tokens) == len(response_tokens):
        raise ValueError("trajectory_metrics: one entry per trajectory in every argument")
    if n == 0:
        return {}
    total = sum(response_tokens)
    return {
        f"{prefix}/turns_mean": sum(turns) / n,
        f"{prefix}/tool_calls_mean": sum(tool_calls) / n,
        f"{prefix}/tool_errors_mean": sum(tool_errors) / n,
        f"{prefix}/tool_call_rate": sum(1 for c in tool_calls if c > 0) / n,
        f"{prefix}/env_token_share": (total - sum(student_tokens)) / total if total else 0.0,
        f"{prefix}/truncated_turns_rate": sum(1 for t in truncated_by if t == "turns") / n,
        f"{prefix}/truncated_tokens_rate": sum(1 for t in truncated_by if t == "tokens") / n,
    }
