"""Benchmark evaluation with any rollout engine: generate, score with math-verify, tabulate.

For benchmark b with problems i = 1..N_b and k_b samples each, correctness c_ij in {0, 1}
(megaopd.metrics.reward: the answer EvalConfig.reward.extract reads from sample j, by default its last
\\boxed{}, verifies against the gold answer):
    acc_b   = 1/N_b sum_i (1/k_b sum_j c_ij)        reported as pass@1 (k_b = 1) or avg@k_b
    pass@k_b = 1/N_b sum_i max_j c_ij               (also in results.json, for k_b > 1)
    Avg     = unweighted mean of acc_b over the benchmarks evaluated (the paper's "Avg." column)
    truncation / repetition rates over all generations of b (megaopd.metrics.rollout)
    answers found: the samples of b with an extractable answer (right or wrong); when fewer than 10% have
    one, the accuracy measures the extraction, not the model, and answers_warning() says how to switch

The same function serves `megaopd eval` (full suites, results table) and the trainer's validation
(a fixed subset every eval_interval steps: `limit`, then `EvalResult.to_metrics("val")`).

    from megaopd.eval import evaluate, EvalConfig
    result = evaluate(EvalModel(engine, tokenizer), ["math500", "aime24"], EvalConfig(temperature=0.6), out_dir="eval/")
    print(result.markdown())

Files written to out_dir: generations.jsonl (every sample with its verdict, appended as samples complete;
a killed evaluation started again into the same out_dir generates only the missing samples and gives the
same table: megaopd.eval.generations; one started again with another extraction re-scores the stored
responses without generating them), generation_config.json, results.json, results.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

from megaopd.eval.benchmarks import Benchmark, resolve_benchmarks
from megaopd.eval.generations import GenerationRecord, GenerationStore
from megaopd.eval.prompt import prompt_ids
from megaopd.metrics.reward import RewardConfig, extract_and_verify, few_answers_warning
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
    """Most sequences (problem x sample pairs) per engine.generate call (an EnginePool spreads each call
    over its engines, so give it several engines' worth); does not change any sample."""
    limit: int | None = None
    """Evaluate only the first `limit` problems of each benchmark (the trainer's validation subset)."""
    seed: int = 0
    """Sampling seed; sample j of problem i draws from derive_seed(seed, i * k + j, 0), so a rerun (or a
    resumed run, or another engine with the same sampler) repeats the same samples whatever batch_size is."""
    use_chat_template: bool = True
    """Wrap the prompt in the tokenizer's chat template when it has one."""
    repetition: RepetitionConfig = field(default_factory=RepetitionConfig)
    stop_token_ids: list[int] = field(default_factory=list)
    """Ids that end a response (the trainer passes its rollouts' turn end + EOS); empty = the stop ids of the
    prompt template this evaluation renders (megaopd.data.special_tokens), which always include the EOS."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How answers are extracted and verified (`extract`: boxed, latex, number, answer_is, any; the trainer's
    validation passes its metrics.reward, `megaopd eval` its --extract)."""

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
    answers_found: int
    """Samples (of n_problems x samples) with an extractable answer under the evaluation's extraction."""


@dataclass
class EvalResult:
    benchmarks: list[BenchmarkResult]
    label: str = "model"
    config: dict[str, Any] = field(default_factory=dict)
    extract: str = "boxed"
    """The extraction the verdicts were made with (RewardConfig.extract)."""

    @property
    def average(self) -> float:
        return sum(b.accuracy for b in self.benchmarks) / len(self.benchmarks) if self.benchmarks else 0.0

    @property
    def responses(self) -> int:
        return sum(b.n_problems * b.samples for b in self.benchmarks)

    @property
    def answers_found(self) -> int:
        return sum(b.answers_found for b in self.benchmarks)

    def answers_line(self) -> str:
        """ "answers found: 12 of 50 (extract=boxed)"."""
        return f"answers found: {self.answers_found} of {self.responses} (extract={self.extract})"

    def answers_warning(self, set_hint: str) -> str | None:
        """One line when almost no response had an answer (megaopd.metrics.reward.FEW_ANSWERS), naming how to
        switch the extraction (set_hint: "--extract " or "metrics.reward.extract="); None otherwise."""
        return few_answers_warning(self.answers_found, self.responses, self.extract, set_hint)

    def _pooled(self, attr: str) -> float:
        n = sum(b.n_problems * b.samples for b in self.benchmarks)
        return sum(getattr(b, attr) * b.n_problems * b.samples for b in self.benchmarks) / n if n else 0.0

    def to_metrics(self, prefix: str = "val") -> dict[str, float]:
        """Flat metrics for the trainer's log: {prefix}/accuracy (the average), pooled truncation and
        repetition rates over all generations, the share and count of responses with an extractable answer
        ({prefix}/answers_found, {prefix}/answers_found_count), and {prefix}/<benchmark>/accuracy."""
        out = {
            f"{prefix}/accuracy": self.average,
            f"{prefix}/answers_found": self.answers_found / self.responses if self.responses else 0.0,
            f"{prefix}/answers_found_count": float(self.answers_found),
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
            "extract": self.extract,
            "answers_found": self.answers_found,
            "responses": self.responses,
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
            "| truncation (%) | "
            + " | ".join(pct(b.truncation_rate) for b in self.benchmarks)
            + f" | {pct(self._pooled('truncation_rate'))} |",
            "| repetition (%) | "
            + " | ".join(pct(b.repetition_rate) for b in self.benchmarks)
            + f" | {pct(self._pooled('repetition_rate'))} |",
            "| mean response tokens | "
            + " | ".join(f"{b.response_tokens_mean:.0f}" for b in self.benchmarks)
            + f" | {self._pooled('response_tokens_mean'):.0f} |",
            f"| answers found (extract={self.extract}) | "
            + " | ".join(f"{b.answers_found} of {b.n_problems * b.samples}" for b in self.benchmarks)
            + f" | {self.answers_found} of {self.responses} |",
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


def _stop_ids(tokenizer, cfg: EvalConfig) -> list[int]:
    """The EOS and the template's turn end: a base model's EOS (<|endoftext|>) is not where its chat turn
    ends (<|im_end|>), and a response that runs on to the budget would count as truncated."""
    from megaopd.data.special_tokens import rollout_stop_ids
    from megaopd.eval.prompt import _data_config

    stop = cfg.stop_token_ids or rollout_stop_ids(_data_config(tokenizer, cfg.use_chat_template), tokenizer)
    return list(dict.fromkeys(list(stop) + _eos_ids(tokenizer)))


@dataclass
class EvalModel:
    """The model under evaluation: what generates its responses and how its prompts and responses are read."""

    engine: Engine
    """Any Engine (the embedded engine, an HttpEngine, an EnginePool over servers): the seeds make every sample
    independent of the engine and batching."""
    tokenizer: Any
    """Decodes the responses (and renders the default prompts)."""
    label: str = "model"
    """Its row in the results table."""
    prompt_fn: Callable[[str], list[int]] | None = None
    """problem -> prompt ids, overriding the default rendering (the trainer passes its data config's, so
    validation prompts match the rollouts')."""


def evaluate(
    model: EvalModel,
    benchmarks: Iterable[str | Benchmark],
    cfg: EvalConfig | None = None,
    out_dir: str | None = None,
    data_dir: str | None = None,
) -> EvalResult:
    """Generates cfg.samples (or each benchmark's default) responses per problem with `model`, scores
    them, and returns an EvalResult; with out_dir, also writes generations.jsonl (appended as samples
    complete), results.json and results.md there, and a restart into the same out_dir generates only
    the samples generations.jsonl lacks. `benchmarks`: registered names, .jsonl paths or Benchmark objects
    (data_dir: where the registered ones' files are)."""
    cfg = cfg or EvalConfig()
    tokenizer = model.tokenizer
    prompt_fn = model.prompt_fn
    if prompt_fn is None:
        prompt_fn = lambda problem: prompt_ids(tokenizer, problem, cfg.use_chat_template)  # noqa: E731
    suites = resolve_benchmarks(benchmarks, data_dir, cfg.samples)
    store = GenerationStore(out_dir, _generation_settings(cfg)) if out_dir else None
    results = []
    try:
        for bench in suites:
            results.append(_evaluate_one(model.engine, tokenizer, bench, cfg, store, prompt_fn))
            r = results[-1]
            log.info(
                "%s: %s %.1f%% (%d x %d, answers found %d, %.0fs)",
                r.display,
                r.metric,
                100 * r.accuracy,
                r.n_problems,
                r.samples,
                r.answers_found,
                r.seconds,
            )
    finally:
        if store:
            store.close()
    result = EvalResult(results, model.label, config=_config_dict(cfg), extract=cfg.reward.extract)
    if out_dir:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(result.to_json(), f, indent=2)
        with open(os.path.join(out_dir, "results.md"), "w") as f:
            f.write(result.markdown())
    return result


def _config_dict(cfg: EvalConfig) -> dict[str, Any]:
    return asdict(cfg)


def _generation_settings(cfg: EvalConfig) -> dict[str, Any]:
    """What decides a sample (a resumed evaluation must match them); batch_size and limit do not."""
    return {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens,
        "seed": cfg.seed,
        "use_chat_template": cfg.use_chat_template,
    }


def _runs(units: list[int], size: int) -> Iterable[list[int]]:
    """Consecutive stretches of `units` (sorted), cut at gaps and at `size`: one engine call each, since
    a call's seeds are derive_seed(seed, first_prompt_index + i, 0) over consecutive indices."""
    run: list[int] = []
    for u in units:
        if run and (u != run[-1] + 1 or len(run) == size):
            yield run
            run = []
        run.append(u)
    if run:
        yield run


def _evaluate_one(
    engine: Engine, tokenizer, bench: Benchmark, cfg: EvalConfig, store: GenerationStore | None, prompt_fn
) -> BenchmarkResult:
    """Sample j of problem i is unit u = i * k + j, generated as its own sequence (n=1) with the seed
    derive_seed(cfg.seed, u, 0): the same whatever the batching, the engine, or what a resume skips."""
    started = time.perf_counter()
    problems = bench.problems[: cfg.limit] if cfg.limit else bench.problems
    k = bench.samples
    done = dict(store.done(bench.name)) if store else {}
    for (i, j), rec in done.items():
        if i < len(problems) and (rec.id != problems[i].id or rec.samples != k):
            raise ValueError(
                f"{store.path}: the record of {bench.name} problem {i} sample {j} (id {rec.id!r}, {rec.samples} "
                f"samples per problem) does not match this evaluation (id {problems[i].id!r}, {k} samples): "
                "evaluate into another --out folder, or delete the file to start over"
            )
    _rescore(done, len(problems), cfg, store)
    pending = [u for u in range(len(problems) * k) if (u // k, u % k) not in done]
    if done and pending:
        log.info(
            "%s: %d of %d samples already in %s, generating %d",
            bench.display,
            len(problems) * k - len(pending),
            len(problems) * k,
            store.path,
            len(pending),
        )
    params = SamplingParams(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=_stop_ids(tokenizer, cfg),
        n=1,
        seed=cfg.seed,
    )
    prompts: dict[int, list[int]] = {}
    for run in _runs(pending, cfg.batch_size):
        for u in run:
            if u // k not in prompts:
                prompts[u // k] = prompt_fn(problems[u // k].problem)
        samples = engine.generate([prompts[u // k] for u in run], params, first_prompt_index=run[0])
        if len(samples) != len(run):
            raise RuntimeError(f"engine returned {len(samples)} samples for {len(run)} prompts x n=1")
        records = [_score(bench, problems, u, k, s, tokenizer, cfg) for u, s in zip(run, samples)]
        for rec in records:
            done[(rec.index, rec.sample)] = rec
        if store:
            store.append(records)
    ordered = [done[(i, j)] for i in range(len(problems)) for j in range(k)]
    correct = [[float(r.correct) for r in ordered[i * k : (i + 1) * k]] for i in range(len(problems))]
    n_gen = len(ordered)
    return BenchmarkResult(
        name=bench.name,
        display=bench.display,
        metric=bench.metric_name,
        n_problems=len(problems),
        samples=k,
        accuracy=mean_at_k(correct),
        pass_at_k=any_at_k(correct),
        truncation_rate=sum(r.finish_reason == "length" for r in ordered) / n_gen if n_gen else 0.0,
        repetition_rate=sum(r.repetitive for r in ordered) / n_gen if n_gen else 0.0,
        response_tokens_mean=sum(r.response_tokens for r in ordered) / n_gen if n_gen else 0.0,
        seconds=time.perf_counter() - started,
        answers_found=sum(bool(r.extracted and r.extracted.strip()) for r in ordered),
    )


def _rescore(done: dict, n_problems: int, cfg: EvalConfig, store: GenerationStore | None) -> None:
    """Stored samples scored under another extraction get this one's verdicts (appended to the store, where
    the later record wins), so a rerun with another --extract re-scores instead of generating again."""
    stale = [rec for (i, _), rec in done.items() if i < n_problems and rec.extract != cfg.reward.extract]
    for rec in stale:
        verdict = extract_and_verify(rec.response, rec.answer, cfg.reward)
        done[(rec.index, rec.sample)] = dataclasses.replace(
            rec, extracted=verdict.extracted, correct=verdict.correct, extract=cfg.reward.extract
        )
    if stale:
        log.info("re-scored %d stored samples with extract=%s", len(stale), cfg.reward.extract)
        if store:
            store.append(done[(rec.index, rec.sample)] for rec in stale)


def _score(bench: Benchmark, problems, u: int, k: int, s, tokenizer, cfg: EvalConfig) -> GenerationRecord:
    """The record of sample `s`, unit u of the benchmark's k samples per problem: problem u // k, sample u % k."""
    i, j = divmod(u, k)
    prob = problems[i]
    text = tokenizer.decode(s.output_ids, skip_special_tokens=True)
    verdict = extract_and_verify(text, prob.answer, cfg.reward)
    return GenerationRecord(
        benchmark=bench.name,
        index=i,
        id=prob.id,
        sample=j,
        samples=k,
        problem=prob.problem,
        answer=prob.answer,
        response=text,
        extracted=verdict.extracted,
        correct=verdict.correct,
        finish_reason=s.finish_reason,
        response_tokens=len(s.output_ids),
        repetitive=is_repetitive(text, cfg.repetition),
        extract=cfg.reward.extract,
    )
