"""Multi-turn rollouts: the student's turns and an environment's turns as one token sequence per trajectory.

    multi_turn = MultiTurn(cfg.env, max_turns, max_trajectory_tokens, tokenizer)   # tools, limits, template
    samples = multi_turn.generate(engine, examples, params)       # n trajectories per example
    batch = build_rollout_batch(samples, pad_id, n)                # loss_mask_BT: the student's tokens only

A trajectory, token by token (Qwen-style template; docs/environments.md):

    prompt ids (the dataset's, rendered with the tools)                           mask -
    assistant turn 1: the engine's output ids, stop token included             mask 1 (student)
    tool turn: "\\n<|im_start|>user\\n<tool_response>...<|im_end|>\\n<|im_start|>assistant\\n"  mask 0 (environment)
    assistant turn 2: the engine's output ids ...                                mask 1

Each turn the engine continues from the trajectory's token ids (Engine.generate takes ids): the student's
tokens stay exactly as the engine produced them, never decoded and re-encoded (re-tokenization drift would
silently change what is trained). The assistant's text is decoded only for the environment to read; the
environment's answer is appended as the ids the student's chat template renders for tool messages, so the
sequence is the one the model sees at inference. Engine log-probs are kept per generated token (0 on the
environment's), for the parity probe and the off-policy corrections.

A trajectory ends on the environment's final answer (finish "stop", its reward), on rollout.max_turns
(truncated "turns") or on rollout.max_trajectory_tokens / a turn's max_new_tokens (truncated "tokens");
both truncations finish "length", as a long single-turn response does. Sampling is seeded per trajectory
and turn (derive_seed), so a resumed run makes the same trajectories.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Callable

from megaopd.data.special_tokens import turn_end_token
from megaopd.envs import EnvConfig, build_environment
from megaopd.rollout.protocol import Engine, Sample, SamplingParams, TrajectoryStats, derive_seed

_MARK = "\u2063megaopd-assistant-turn\u2063"  # an assistant content no template rewrites


class ToolTurns:
    """The token ids the student's chat template renders for tool results between two assistant turns:
    from just after the assistant's turn-end token (which the student generated) through the next assistant
    header (the generation prompt). Read from the template itself, so Qwen2.5's and Qwen3's
    <tool_response> wrapping (and any other family's tool role) come out as at inference."""

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"multi-turn rollouts need the student tokenizer's chat template to render tool turns; "
                f"{getattr(tokenizer, 'name_or_path', '?')} has none"
            )
        self.tokenizer, self.tools = tokenizer, tools or None
        self.turn_end = turn_end_token(tokenizer)

    def text(self, observations: list[str]) -> str:
        """The environment turn's text for these tool results (one tool message each)."""
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}]
        messages += [{"role": "tool", "content": o} for o in observations]
        rendered = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=True
        )
        at = rendered.find(_MARK)
        end = rendered.find(self.turn_end, at + len(_MARK)) if at >= 0 else -1
        if end < 0:
            raise ValueError(
                f"the chat template of {getattr(self.tokenizer, 'name_or_path', '?')} does not close an "
                f"assistant turn with {self.turn_end!r}: cannot place tool turns after it"
            )
        return rendered[end + len(self.turn_end) :]

    def ids(self, observations: list[str]) -> list[int]:
        """Token ids of text(observations): tokenized on its own, as it follows a special token (the turn
        end) that tokenizers never merge across."""
        return list(self.tokenizer(self.text(observations), add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class TrajectoryLimits:
    """rollout.max_turns and rollout.max_trajectory_tokens (tokens after the prompt, both kinds)."""

    max_turns: int
    max_tokens: int


@dataclass
class _Trajectory:
    prompt_ids: list[int]
    env: object
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stats: TrajectoryStats = field(default_factory=lambda: TrajectoryStats(0, 0, 0))
    finish: str = ""
    weight_version: str | None = None

    def sample(self) -> Sample:
        return Sample(
            list(self.prompt_ids),
            self.ids,
            self.logprobs,
            self.finish or "length",
            weight_version=self.weight_version,
            output_mask=self.mask,
            trajectory=self.stats,
        )


def _generate_turn(
    engine: Engine, active: list[_Trajectory], params: SamplingParams, turn: int, max_tokens: int
) -> None:
    """One assistant turn of every active trajectory, continuing from its token ids: one engine call per
    token budget (what is left of max_trajectory_tokens, at most max_new_tokens). Seeds: the engine derives
    request k's from (the turn's seed, k), a pure function of the step's seed and of which trajectories are
    still going, so a resumed run makes the same trajectories."""
    groups: dict[int, list[_Trajectory]] = {}
    for t in active:
        groups.setdefault(min(params.max_new_tokens, max_tokens - len(t.ids)), []).append(t)
    for budget, group in sorted(groups.items()):
        seed = None if params.seed is None else derive_seed(params.seed, turn, budget)
        samples = engine.generate(
            [t.prompt_ids + t.ids for t in group], replace(params, n=1, max_new_tokens=budget, seed=seed)
        )
        for t, s in zip(group, samples):
            t.ids += s.output_ids
            t.mask += [1] * len(s.output_ids)
            t.logprobs += list(s.output_logprobs)
            t.stats.turns += 1
            t.weight_version = s.weight_version
            if s.finish_reason != "stop":
                t.finish = s.finish_reason  # "length": out of tokens; "abort": the engine dropped it
                if s.finish_reason == "length":
                    t.stats.truncated_by = "tokens"


def _environment_turn(t: _Trajectory, turn: int, limits: TrajectoryLimits, turns: ToolTurns, decode) -> None:
    """The environment's answer to t's last assistant turn: done (a final answer), or a tool turn appended
    with mask 0; a trajectory that cannot take another turn (max_turns, or no tokens left for the tool
    turn and one more token) is truncated without it."""
    if t.finish:
        return
    last = t.ids[len(t.ids) - _last_turn_len(t) :]
    result = t.env.step(decode(last))
    t.stats.tool_calls += result.tool_calls
    t.stats.tool_errors += result.tool_errors
    if result.done:
        t.finish, t.stats.reward, t.stats.final_text = "stop", float(result.reward), decode(last)
        return
    env_ids = turns.ids(result.observations)
    if turn + 1 >= limits.max_turns:
        t.finish, t.stats.truncated_by = "length", "turns"
    elif len(t.ids) + len(env_ids) + 1 > limits.max_tokens:
        t.finish, t.stats.truncated_by = "length", "tokens"
    else:
        t.ids += env_ids
        t.mask += [0] * len(env_ids)
        t.logprobs += [0.0] * len(env_ids)


def _last_turn_len(t: _Trajectory) -> int:
    """Tokens of the last assistant turn (the trailing run of mask 1)."""
    n = 0
    for m in reversed(t.mask):
        if not m:
            break
        n += 1
    return n


class MultiTurn:
    """The trainer's multi-turn rollouts (env.name set): trajectories instead of single responses, their
    texts (the student's turns only: repetition metrics, samples) and rewards (the environment's)."""

    def __init__(self, env_cfg: EnvConfig, max_turns: int, max_trajectory_tokens: int, tokenizer):
        self.env_cfg, self.tokenizer = env_cfg, tokenizer
        self.tools = list(build_environment(env_cfg).tools)
        self.turns = ToolTurns(tokenizer, self.tools)
        self.limits = TrajectoryLimits(max_turns, max_trajectory_tokens)

    def generate(self, engine: Engine, examples: list, params: SamplingParams) -> list[Sample]:
        """params.n trajectories per example, prompt-major (as Engine.generate returns samples); the environment
        reads the assistant's text decoded with special tokens kept."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        trajs = []
        for ex in examples:
            for _ in range(params.n):
                env = build_environment(self.env_cfg)
                env.reset(ex)
                trajs.append(_Trajectory(list(ex.prompt_ids), env))
        for turn in range(self.limits.max_turns):
            active = [t for t in trajs if not t.finish]
            if not active:
                break
            _generate_turn(engine, active, params, turn, self.limits.max_tokens)
            for t in active:
                _environment_turn(t, turn, self.limits, self.turns, decode)
        return [t.sample() for t in trajs]

    def texts_and_rewards(self, samples: list[Sample]) -> tuple[list[str], list[float]]:
        texts = [
            self.tokenizer.decode([i for i, m in zip(s.output_ids, s.output_mask) if m], skip_special_tokens=True)
            for s in samples
        ]
        return texts, [s.trajectory.reward for s in samples]


def generate_rows(
    engine: Engine,
    examples: list,
    params: SamplingParams,
    multi_turn: MultiTurn | None,
    parts: int = 1,
    on_part: Callable[[int, list, list[Sample]], None] | None = None,
) -> list[Sample]:
    """The step's rows: n single-turn responses per prompt (the default), or n trajectories per data row.

    parts > 1 with on_part (single-turn): the prompts go to the engine as `parts` concurrent requests of
    contiguous prompts, each with its prompts' batch indices (first_prompt_index), so every sample keeps the
    seed one request gives it; on_part(first_row, examples, samples) runs in a part's thread as it returns."""
    if multi_turn is not None:
        return multi_turn.generate(engine, examples, params)
    prompts = [ex.prompt_ids for ex in examples]
    if parts <= 1 or on_part is None or len(prompts) < 2:
        return engine.generate(prompts, params)
    size = -(-len(prompts) // parts)
    starts = list(range(0, len(prompts), size))
    out: list[list[Sample] | BaseException | None] = [None] * len(starts)

    def run(k: int, a: int) -> None:
        try:
            out[k] = engine.generate(prompts[a : a + size], params, first_prompt_index=a)
            on_part(a * params.n, examples[a : a + size], out[k])
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            out[k] = e

    threads = [
        threading.Thread(target=run, args=(k, a), daemon=True, name=f"megaopd-part-{a}") for k, a in enumerate(starts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [o for o in out if isinstance(o, BaseException)]
    if errors:
        raise errors[0]
    return [s for part in out for s in part]
