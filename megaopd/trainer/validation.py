"""Validation during training: the benchmark evaluation (megaopd.eval) on the rollout engine, which holds
the actor's current weights, so validation needs no second copy of the model. Rank 0 drives the engine;
every rank receives the metrics (the loop logs and decides on them in lockstep). Answers are extracted as
the rewards extract them (metrics.reward.extract); val/answers_found says how many responses had one, and
a validation where almost none did logs a one-line `few_answers` warning.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from megaopd.rollout.waits import rank0_waits

if TYPE_CHECKING:  # annotations only: config composes every package's section, so no package imports it
    from megaopd.config.schema import MegaOPDConfig


def validate(engine, tokenizer, cfg: MegaOPDConfig, step: int, stop_ids: list[int], run_log=None) -> dict[str, float]:
    """val/accuracy, val/truncation_rate, ... of the configured validation file (empty without one).
    Generations stop where rollouts do (stop_ids). Collective; `engine` and `run_log` (which records the
    evaluation table) are used on rank 0 only."""
    if not cfg.validation.path:
        return {}
    return rank0_waits(_evaluate, engine, tokenizer, cfg, step, stop_ids, run_log)  # abandoned: on every rank


def _evaluate(engine, tokenizer, cfg: MegaOPDConfig, step: int, stop_ids: list[int], run_log) -> dict[str, float]:
    if cfg.env.enabled:
        return _evaluate_with_tools(engine, tokenizer, cfg, stop_ids)
    from megaopd.data.templates import render_and_encode
    from megaopd.eval.benchmarks import load_benchmark_file
    from megaopd.eval.evaluate import EvalConfig, EvalModel, evaluate

    vcfg = cfg.validation
    bench = load_benchmark_file(vcfg.path, name="val", samples=vcfg.samples)
    result = evaluate(
        EvalModel(engine, tokenizer, prompt_fn=lambda problem: render_and_encode(problem, cfg.data, tokenizer)[1]),
        [bench],
        EvalConfig(
            samples=vcfg.samples,
            temperature=vcfg.temperature,
            max_new_tokens=vcfg.max_new_tokens,
            limit=vcfg.max_problems or None,
            repetition=cfg.metrics.repetition,
            stop_token_ids=stop_ids,
            reward=cfg.metrics.reward,
        ),
        out_dir=os.path.join(cfg.run.dir, "eval", f"step_{step:06d}"),
    )
    if run_log is not None:
        run_log.evaluation(step, result)
    _warn_if_few_answers(result, step, run_log)
    return {k: v for k, v in result.to_metrics("val").items() if k.count("/") == 1}


def _warn_if_few_answers(result, step: int, run_log) -> None:
    """One line when almost no validation response had an answer to grade: val/accuracy then reads 0.0
    whatever the model knows (a model that never boxes, under metrics.reward.extract=boxed)."""
    warning = result.answers_warning("metrics.reward.extract=")
    if warning is None:
        return
    if run_log is not None:
        run_log.event(
            step, "few_answers", warning, loud=True, answers_found=result.answers_found, responses=result.responses
        )
    else:
        logging.getLogger(__name__).warning("step %d: %s", step, warning)


def _evaluate_with_tools(engine, tokenizer, cfg: MegaOPDConfig, stop_ids: list[int]) -> dict[str, float]:
    """Multi-turn validation (env.name set): one trajectory per problem with the job's environment and
    limits (megaopd.rollout.trajectories), at the validation temperature and turn budget: val/accuracy is
    pass@1 with tools (the environment's final-answer reward), with val/tool_call_rate, val/turns_mean and
    val/truncation_rate beside it."""
    from types import SimpleNamespace

    from megaopd.data.templates import encode_prompt, render_prompt
    from megaopd.eval.benchmarks import load_benchmark_file
    from megaopd.rollout.protocol import SamplingParams
    from megaopd.rollout.trajectories import MultiTurn

    vcfg, r = cfg.validation, cfg.rollout
    multi_turn = MultiTurn(cfg.env, r.max_turns, r.max_trajectory_tokens, tokenizer)
    problems = load_benchmark_file(vcfg.path, name="val").problems[: vcfg.max_problems or None]
    examples = [
        SimpleNamespace(
            problem=p.problem,
            answer=p.answer,
            prompt_ids=encode_prompt(
                render_prompt(p.problem, cfg.data, tokenizer, tools=multi_turn.tools), cfg.data, tokenizer
            ),
        )
        for p in problems
    ]
    samples = multi_turn.generate(
        engine,
        examples,
        SamplingParams(
            temperature=vcfg.temperature, max_new_tokens=vcfg.max_new_tokens, stop_token_ids=stop_ids, n=1, seed=0
        ),
    )
    n = max(len(samples), 1)
    return {
        "val/accuracy": sum(s.trajectory.reward for s in samples) / n,
        "val/tool_call_rate": sum(s.trajectory.tool_calls > 0 for s in samples) / n,
        "val/turns_mean": sum(s.trajectory.turns for s in samples) / n,
        "val/truncation_rate": sum(s.finish_reason == "length" for s in samples) / n,
    }
