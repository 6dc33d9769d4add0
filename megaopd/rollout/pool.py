"""A pool of rollout engines behind the one Engine protocol: spreads prompts, survives engine failures.

    pool = EnginePool([HttpEngine(u) for u in urls], PoolConfig(prompts_per_job=8))
    samples = pool.generate(prompts, SamplingParams(n=4, seed=step))   # prompt-major, in input order
    WeightSync(pool, rollout_cfg, rank=0).push(...)                      # megaopd.sync: weights go to
                                                                          # pool.weight_targets()

How: the prompts are cut into jobs (consecutive prompts, all n samples of a prompt in one job); one
thread per engine takes jobs from a shared queue, so a fast engine takes more. A job whose engine
raises (down, timed out, answered garbage) goes back on the queue for another engine and that engine
takes no more jobs in this call; a job fails for good after `max_attempts` engines, and the call fails
when no engine is left or `timeout_s` passes (nothing waits forever: each HttpEngine request has its
own timeout too). Jobs carry their offset in the batch (first_prompt_index), so a seeded batch gives
the same samples whichever engine ran which job.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from megaopd.rollout.protocol import Engine, Sample, SamplingParams
from megaopd.rollout.waits import WaitAbandoned

W, J, R = TypeVar("W"), TypeVar("J"), TypeVar("R")


class PoolError(RuntimeError):
    """The pool could not finish a generate: every engine failed, a job failed too often, or timeout."""


@dataclass
class PoolConfig:
    prompts_per_job: int | None = None
    """Prompts per job; None = an even split, one job per engine (a failed job is resubmitted whole)."""
    max_attempts: int = 3
    """Engines a job may be tried on before the generate fails."""
    timeout_s: float = 3600.0
    """Longest time one generate call may take."""
    recheck_failed: bool = True
    """At the start of each call, engines that failed earlier are used again if health() says so."""

    def __post_init__(self):
        if self.prompts_per_job is not None and self.prompts_per_job < 1:
            raise ValueError(f"prompts_per_job={self.prompts_per_job} must be >= 1 or None")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")


@dataclass
class _Job:
    start: int
    """Index of the job's first prompt in the batch."""
    prompts: list[list[int]]


@dataclass
class JobFailure:
    """Why spread_jobs gave up on one job."""

    job: int
    """Index of the job in the list given to spread_jobs."""
    attempts: int
    """Workers that failed on it."""
    errors: tuple[str, ...]
    """One "<worker>: <error type>: <message>" per failed attempt, in order."""
    refused: bool
    """A worker raised one of the `refuse` exceptions (the job itself is bad: no other worker was tried)."""
    worker: str
    """label() of the worker that failed last."""
    error: BaseException
    """What it raised."""


class SpreadError(RuntimeError):
    """spread_jobs could not finish: the callers turn it into their own error (PoolError, RemoteTeacherError)."""

    def __init__(self, timed_out: bool, done: int, total: int, failures: list[JobFailure]):
        self.timed_out, self.done, self.total, self.failures = timed_out, done, total, failures
        what = "timed out" if timed_out else "; ".join(" | ".join(f.errors) for f in failures)
        super().__init__(f"{done}/{total} jobs done: {what}")


@dataclass(frozen=True, kw_only=True)
class SpreadRules:
    """How spread_jobs treats time and failures, and how it names its threads and workers."""

    timeout_s: float
    """The whole call's limit: SpreadError(timed_out) when it passes (nothing waits forever)."""
    max_attempts: int | None = None
    """Failed workers after which a job fails for good; None: as many as there are."""
    refuse: tuple[type[BaseException], ...] = ()
    """Exceptions that mean the job itself is bad (another worker would refuse it too): the call fails at once."""
    label: Callable[[Any], str] = repr
    """A worker's name in the errors."""
    name: str = "megaopd-jobs"
    """Prefix of the worker threads' names."""
    on_worker_failed: Callable[[int], None] | None = None
    """Called with a worker's index when its call raised (it takes no more jobs in this call)."""


def spread_jobs(workers: Sequence[W], jobs: Sequence[J], call: Callable[[W, J], R], rules: SpreadRules) -> list[R]:
    """call(worker, job) for every job, spread over the workers: one thread per worker takes jobs from a
    shared queue (a fast worker takes more). Returns the results in job order.

    A worker whose call raises takes no more jobs in this call (rules.on_worker_failed(its index) is called)
    and the job goes back on the queue for another worker; it fails for good after `rules.max_attempts`
    failed workers or when no worker is left. An exception of a `rules.refuse` type fails the call at once.
    Raises SpreadError (timed_out when `rules.timeout_s` passes first), or WaitAbandoned as soon as a
    worker's wait was given up (a preemption signal: no other worker is tried)."""
    max_attempts, refuse, label, on_worker_failed = (
        rules.max_attempts,
        rules.refuse,
        rules.label,
        rules.on_worker_failed,
    )
    if not jobs:
        return []
    todo: "queue.Queue[int]" = queue.Queue()
    for j in range(len(jobs)):
        todo.put(j)
    results: dict[int, R] = {}
    attempts, errors = [0] * len(jobs), [()] * len(jobs)
    failures: list[JobFailure] = []
    lock, done = threading.Lock(), threading.Event()
    alive = [True] * len(workers)
    abandoned: list[WaitAbandoned] = []

    def work(i: int):
        worker = workers[i]
        while not done.is_set():
            try:
                j = todo.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                out = call(worker, jobs[j])
            except WaitAbandoned as e:  # not the worker's failure: the whole call is given up
                abandoned.append(e)
                done.set()
                return
            except refuse as e:
                with lock:
                    failures.append(
                        JobFailure(j, attempts[j] + 1, errors[j] + (f"{label(worker)}: {e}",), True, label(worker), e)
                    )
                    done.set()
                return
            except Exception as e:  # noqa: BLE001 - any worker failure sends the job elsewhere
                with lock:
                    attempts[j] += 1
                    errors[j] += (f"{label(worker)}: {type(e).__name__}: {e}",)
                    alive[i] = False
                    if on_worker_failed is not None:
                        on_worker_failed(i)
                    if (max_attempts is not None and attempts[j] >= max_attempts) or not any(alive):
                        failures.append(JobFailure(j, attempts[j], errors[j], False, label(worker), e))
                        done.set()
                    else:
                        todo.put(j)
                return  # this worker takes no more jobs in this call
            with lock:
                results[j] = out
                if len(results) == len(jobs):
                    done.set()

    threads = [
        threading.Thread(target=work, args=(i,), daemon=True, name=f"{rules.name}-{i}") for i in range(len(workers))
    ]
    for t in threads:
        t.start()
    if not done.wait(timeout=rules.timeout_s):
        done.set()
        raise SpreadError(True, len(results), len(jobs), [])
    if abandoned:
        raise abandoned[0]
    if failures:
        raise SpreadError(False, len(results), len(jobs), list(failures))
    return [results[j] for j in range(len(jobs))]


class EnginePool:
    def __init__(self, engines: list[Engine], config: PoolConfig | None = None):
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.engines = list(engines)
        self.config = config or PoolConfig()
        self.failed: set[int] = set()  # indices of engines that failed and were not healthy since
        # generate() runs in several threads at once (batches generated ahead, rollout.stream_parts): one
        # health recheck at a time, and the failed set changed under it.
        self._lock = threading.Lock()

    @property
    def weight_transports(self) -> tuple[str, ...]:
        """Transports every member accepts (megaopd.sync picks per member from weight_targets())."""
        common = [
            t for t in self.engines[0].weight_transports if all(t in e.weight_transports for e in self.engines[1:])
        ]
        return tuple(common)

    def weight_targets(self) -> list[Engine]:
        """Every member receives the weights, failed ones included (they may come back)."""
        return [t for e in self.engines for t in e.weight_targets()]

    def healthy_engines(self) -> list[int]:
        with self._lock:
            if self.config.recheck_failed:
                for i in sorted(self.failed):
                    if self.engines[i].health():
                        self.failed.discard(i)
            return [i for i in range(len(self.engines)) if i not in self.failed]

    def _mark_failed(self, i: int) -> None:
        with self._lock:
            self.failed.add(i)

    def generate(self, prompts: list[list[int]], params: SamplingParams, first_prompt_index: int = 0) -> list[Sample]:
        if not prompts:
            return []
        live = self.healthy_engines()
        if not live:
            raise PoolError(f"no healthy engine among {len(self.engines)}")
        per_job = self.config.prompts_per_job or -(-len(prompts) // len(live))
        jobs = [_Job(s, prompts[s : s + per_job]) for s in range(0, len(prompts), per_job)]

        def run(engine: Engine, job: _Job) -> list[Sample]:
            out = engine.generate(job.prompts, params, first_prompt_index=first_prompt_index + job.start)
            if len(out) != len(job.prompts) * params.n:
                raise RuntimeError(f"returned {len(out)} samples for {len(job.prompts)} prompts x n={params.n}")
            return out

        try:
            outs = spread_jobs(
                [self.engines[i] for i in live],
                jobs,
                run,
                SpreadRules(
                    timeout_s=self.config.timeout_s,
                    max_attempts=self.config.max_attempts,
                    name="megaopd-pool",
                    on_worker_failed=lambda k: self._mark_failed(live[k]),
                ),
            )
        except SpreadError as e:
            if e.timed_out:
                raise PoolError(
                    f"generate did not finish in {self.config.timeout_s:.0f}s ({e.done}/{e.total} jobs done)"
                ) from None
            raise PoolError(
                "; ".join(
                    f"prompts {jobs[f.job].start}..{jobs[f.job].start + len(jobs[f.job].prompts) - 1} failed on "
                    f"{f.attempts} engine(s): " + " | ".join(f.errors)
                    for f in e.failures
                )
            ) from None
        return [s for out in outs for s in out]

    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        """Prompt log-probs from the first healthy engine that has them (all engines hold the same weights)."""
        errors = []
        for i in self.healthy_engines():
            fn = getattr(self.engines[i], "prompt_logprobs", None)
            if fn is None:
                continue
            try:
                return fn(prompt_ids)
            except WaitAbandoned:
                raise
            except Exception as e:  # noqa: BLE001 - try the next engine
                errors.append(f"{self.engines[i]!r}: {e}")
        raise PoolError("no engine could score the prompt" + (f": {errors}" if errors else ""))

    def release_memory(self, tags: list[str] | None = None) -> None:
        for e in self.engines:
            e.release_memory(tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Resumes `tags` on every member; a member that did not release one of them refuses (before any
        request), as SGLang would die on it."""
        for e in self.engines:
            e.resume_memory(tags)

    @property
    def released_tags(self) -> frozenset[str]:
        """Tags released on every member (what resume_memory may name)."""
        tags = [e.released_tags for e in self.engines]
        return frozenset.intersection(*tags)

    def health(self) -> bool:
        return bool(self.healthy_engines())

    def close(self) -> None:
        for e in self.engines:
            close = getattr(e, "close", None)
            if close is not None:
                close()
