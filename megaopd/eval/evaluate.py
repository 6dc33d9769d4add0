"""Benchmark evaluation with any rollout engine: generate, score with math-verify, tabulate.

For benchmark b with problems i = 1..N_b and k_b samples each, correctness c_ij in {0, 1}
(math_verify_reward: the last \\boxed{} of sample j verifies against the gold answer):
    acc_b   = 1/N_b sum_i (1/k_b sum_j c_ij)        reported as pass@1 (k_b = 1) or avg@k_b
    pass@k_b = 1/N_b sum_i max_j c_ij               (also in results.json, for k_b > 1)
    Avg     = unweighted mean of acc_b over the benchmarks evaluated (the paper's "Avg." column)
    truncation / repetition rates over all generations of b (megaopd.metrics.rollout)

The same function serves `megaopd eval` (full suites, results table) and the trainer's validation
(a fixed subset every eval_interval steps: `limit`, then `EvalResult.to_metrics("val")`).

    from megaopd.eval import evaluate, EvalConfig
    result = evaluate(engine, tokenizer, ["math500", "aime24"], EvalConfig(temperature=0.6), out_dir="eval/")
    print(result.markdown())

Files written to out_dir: generations.jsonl (every sample with its verdict), results.json, results.md.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

from megaopd.eval.benchmarks import Benchmark, resolve_benchmarks
from megaopd.eval.prompt import prompt_ids
from megaopd.metrics.reward import RewardConfig, last_boxed, math_verify_reward
from megaopd.metrics.rollout import RepetitionConfig, is_repetitive
from megaopd.rollout.protocol import Engine, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    """Sampling and scoring settings of an evaluation."""

    samples: int | None = None
    """Samples per problem for every benchmark; None keeps each benchmark's default (pass@1 or avg@32)."""
    temperature: float = 0.6
    """Sampling temperature (paper 2604.08527: 0.6)."""
    top_p: float = 1.0
    max_new_tokens: int = 8192
    """Token budget per response (ours; long-CoT evaluations use 8k-32k); a response that uses it all counts
    as truncated (and usually wrong)."""
    batch_size: int = 64
    """Most sequences (prompts x samples) per engine.generate call; at least one prompt per call."""
    limit: int | None = None
    """Evaluate only the first `limit` problems of each benchmark (the trainer's validation subset)."""
    seed: int = 0
    """Sampling seed; the engine derives one stream per (problem index, sample), so a rerun repeats the
    same samples whatever batch_size is."""
    use_chat_template: bool = True
    """Wrap the prompt in the tokenizer's chat template when it has one."""
    repetition: RepetitionConfig = field(default_factory=RepetitionConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

    def __post_init__(self):
        if self.samples is not None and self.samples < 1:
            raise ValueError(f"samples={self.samples} must be at least 1 (or None for the defaults)")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be at least 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit} must be at least 1 (or None for all problems)")


@dataclass
class BenchmarkResult:
    name: str
    display: str
    metric: str
    """"pass@1" or "avg@k"."""
    n_problems: int
    samples: int
    accuracy: float
    """Mean over problems of the mean correctness over samples, in [0, 1]."""
    pass_at_k: float
    """Fraction of problems with at least one correct sample (equals accuracy when samples = 1)."""
    truncation_rate: float
    repetition_rate: float
    response_tokens_mean: float
    seconds: float


@dataclass
class EvalResult:
    benchmarks: list[BenchmarkResult]
    label: str = "model"
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def average(self) -> float:
        return sum(b.accuracy for b in self.benchmarks) / len(self.benchmarks) if self.benchmarks else 0.0

    def _pooled(self, attr: str) -> float:
        n = sum(b.n_problems * b.samples for b in self.benchmarks)
        return sum(getattr(b, attr) * b.n_problems * b.samples for b in self.benchmarks) / n if n else 0.0

    def to_metrics(self, prefix: str = "val") -> dict[str, float]:
        """Flat metrics for the trainer's log: {prefix}/accuracy (the average), pooled truncation and
        repetition rates over all generations, and {prefix}/<benchmark>/accuracy."""
        out = {
            f"{prefix}/accuracy": self.average,
            f"{prefix}/truncation_rate": self._pooled("truncation_rate"),
            f"{prefix}/repetition_rate": self._pooled("repetition_rate"),
            f"{prefix}/response_length_mean": self._pooled("response_tokens_mean"),
        }
        for b in self.benchmarks:
            out[f"{prefix}/{b.name}/accuracy"] = b.accuracy
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "columns": [b.display for b in self.benchmarks] + ["Avg"],
            "average": self.average,
            "truncation_rate": self._pooled("truncation_rate"),
            "repetition_rate": self._pooled("repetition_rate"),
            "benchmarks": [asdict(b) for b in self.benchmarks],
            "config": self.config,
        }

    def markdown(self) -> str:
        """Accuracy table in the paper's column order (percent, one decimal), then generation health."""
        heads = [b.display for b in self.benchmarks]
        pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
        lines = [
            "| Model | " + " | ".join(heads) + " | Avg |",
            "|---|" + "---:|" * (len(heads) + 1),
            f"| {self.label} | " + " | ".join(pct(b.accuracy) for b in self.benchmarks) + f" | {pct(self.average)} |",
            "",
            "| | " + " | ".join(heads) + " | All |",
            "|---|" + "---:|" * (len(heads) + 1),
            "| metric | " + " | ".join(b.metric for b in self.benchmarks) + " | |",
            "| problems x samples | " + " | ".join(f"{b.n_problems}x{b.samples}" for b in self.benchmarks) + " | |",
            "| truncation (%) | " + " | ".join(pct(b.truncation_rate) for b in self.benchmarks)
            + f" | {pct(self._pooled('truncation_rate'))} |",
            "| repetition (%) | " + " | ".join(pct(b.repetition_rate) for b in self.benchmarks)
            + f" | {pct(self._pooled('repetition_rate'))} |",
            "| mean response tokens | " + " | ".join(f"{b.response_tokens_mean:.0f}" for b in self.benchmarks)
            + f" | {self._pooled('response_tokens_mean'):.0f} |",
        ]
        return "\n".join(lines) + "\n"


def mean_at_k(correct: list[list[float]]) -> float:
    """1/N sum_i (1/k_i sum_j c_ij): pass@1 for one sample per problem, avg@k for k."""
    if not correct:
        return 0.0
    return sum(sum(c) / len(c) for c in correct) / len(correct)


def any_at_k(correct: list[list[float]]) -> float:
    """Fraction of problems with at least one correct sample."""
    if not correct:
        return 0.0
    return sum(1.0 for c in correct if max(c) > 0) / len(correct)


def _eos_ids(tokenizer) -> list[int]:
    ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [int(ids)]


def evaluate(
    engine: Engine,
    tokenizer,
    benchmarks: Iterable[str | Benchmark],
    cfg: EvalConfig | None = None,
    out_dir: str | None = None,
    data_dir: str | None = None,
    label: str = "model",
    prompt_fn: Callable[[str], list[int]] | None = None,
) -> EvalResult:
    """Generates cfg.samples (or each benchmark's default) responses per problem with `engine`, scores
    them, and returns an EvalResult; with out_dir, also writes generations.jsonl, results.json and
    results.md there. `benchmarks`: registered names, .jsonl paths or Benchmark objects. prompt_fn(problem)
    -> prompt ids overrides the default rendering (the trainer passes its data config's, so validation
    prompts match the rollouts')."""
    cfg = cfg or EvalConfig()
    if prompt_fn is None:
        prompt_fn = lambda problem: prompt_ids(tokenizer, problem, cfg.use_chat_template)  # noqa: E731
    suites = resolve_benchmarks(benchmarks, data_dir, cfg.samples)
    gen_file = None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        gen_file = open(os.path.join(out_dir, "generations.jsonl"), "w", encoding="utf-8")
    results = []
    try:
        for bench in suites:
            results.append(_evaluate_one(engine, tokenizer, bench, cfg, gen_file, prompt_fn))
            r = results[-1]
            log.info("%s: %s %.1f%% (%d x %d, %.0fs)", r.display, r.metric, 100 * r.accuracy, r.n_problems, r.samples, r.seconds)
    finally:
        if gen_file:
            gen_file.close()
    result = EvalResult(results, label, config=_config_dict(cfg))
    if out_dir:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(result.to_json(), f, indent=2)
        with open(os.path.join(out_dir, "results.md"), "w") as f:
            f.write(result.markdown())
    return result


def _config_dict(cfg: EvalConfig) -> dict[str, Any]:
    return asdict(cfg)


def _evaluate_one(engine: Engine, tokenizer, bench: Benchmark, cfg: EvalConfig, gen_file, prompt_fn) -> BenchmarkResult:
    started = time.perf_counter()
    problems = bench.problems[: cfg.limit] if cfg.limit else bench.problems
    k = bench.samples
    per_call = max(1, cfg.batch_size // k)
    correct: list[list[float]] = []
    n_trunc = n_rep = n_tokens = n_gen = 0
    stop_ids = _eos_ids(tokenizer)
    for start in range(0, len(problems), per_call):
        chunk = problems[start : start + per_call]
        prompts = [prompt_fn(p.problem) for p in chunk]
        params = SamplingParams(
            temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=stop_ids, n=k, seed=cfg.seed,
        )
        samples = engine.generate(prompts, params, first_prompt_index=start)
        if len(samples) != len(chunk) * k:
            raise RuntimeError(f"engine returned {len(samples)} samples for {len(chunk)} prompts x n={k}")
        for i, prob in enumerate(chunk):
            verdicts = []
            for j in range(k):
                s = samples[i * k + j]  # prompt-major (Engine protocol)
                text = tokenizer.decode(s.output_ids, skip_special_tokens=True)
                score = math_verify_reward(text, prob.answer, cfg.reward)
                repetitive = is_repetitive(text, cfg.repetition)
                verdicts.append(score)
                n_trunc += s.finish_reason == "length"
                n_rep += repetitive
                n_tokens += len(s.output_ids)
                n_gen += 1
                if gen_file:
                    gen_file.write(json.dumps({
                        "benchmark": bench.name, "id": prob.id, "sample": j, "problem": prob.problem,
                        "answer": prob.answer, "response": text, "extracted": last_boxed(text),
                        "correct": bool(score), "finish_reason": s.finish_reason,
                        "response_tokens": len(s.output_ids), "repetitive": repetitive,
                    }, ensure_ascii=False) + "\n")
            correct.append(verdicts)
        if gen_file:
            gen_file.flush()
    return BenchmarkResult(
        name=bench.name, display=bench.display, metric=bench.metric_name, n_problems=len(problems), samples=k,
        accuracy=mean_at_k(correct), pass_at_k=any_at_k(correct),
        truncation_rate=n_trunc / n_gen if n_gen else 0.0, repetition_rate=n_rep / n_gen if n_gen else 0.0,
        response_tokens_mean=n_tokens / n_gen if n_gen else 0.0, seconds=time.perf_counter() - started,
    )
