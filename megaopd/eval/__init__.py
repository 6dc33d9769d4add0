"""megaopd.eval: math benchmarks (MATH-500, Minerva, OlympiadBench, AMC, AIME24, AIME25), pass@1 / avg@k
with math-verify, result tables; used by `megaopd eval` and by the trainer's validation.

    benchmarks.py  local jsonl format {"id", "problem", "answer"}, registry, conversion of public releases
    prompt.py      problem + "Please reason step by step, ..." in the tokenizer's chat template
    evaluate.py    evaluate(EvalModel(engine, tokenizer), benchmarks, EvalConfig, out_dir) -> EvalResult (any Engine)
    generations.py OUT/generations.jsonl: appended as samples complete, read back to resume a killed run
    engines.py     engine_pool("URL,URL"): the trainer's EnginePool over SGLang / megaopd serve servers
    table.py       `python -m megaopd.eval.table DIR...`: one table, a row per evaluated checkpoint
    cli.py         `megaopd eval --ckpt DIR --benchmarks ... [--engines URL,...]`
"""

from megaopd.eval.benchmarks import (
    BENCHMARKS,
    Benchmark,
    BenchmarkSpec,
    Problem,
    load_benchmark_file,
    resolve_benchmarks,
)
from megaopd.eval.evaluate import BenchmarkResult, EvalConfig, EvalModel, EvalResult, any_at_k, evaluate, mean_at_k
from megaopd.eval.prompt import PROMPT_SUFFIX, format_problem, prompt_ids, prompt_text

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "BenchmarkSpec",
    "Problem",
    "load_benchmark_file",
    "resolve_benchmarks",
    "BenchmarkResult",
    "EvalConfig",
    "EvalModel",
    "EvalResult",
    "any_at_k",
    "evaluate",
    "mean_at_k",
    "PROMPT_SUFFIX",
    "format_problem",
    "prompt_ids",
    "prompt_text",
]
