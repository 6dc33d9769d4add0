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
from megaopd.rollout.protocol import Engine, Sample, SamplingParams


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
    prompts: list[list[int]]
    attempts: int = 0
    errors: tuple[str, ...] = ()


class EnginePool:
    def __init__(self, engines: list[Engine], config: PoolConfig | None = None):
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.engines = list(engines)
        self.config = config or PoolConfig()
        self.failed: set[int] = set()  # indices of engines that failed and were not healthy since

    @property
    def weight_transports(self) -> tuple[str, ...]:
        """Transports every member accepts (megaopd.sync picks per member from weight_targets())."""
        common = [t for t in self.engines[0].weight_transports
                  if all(t in e.weight_transports for e in self.engines[1:])]
        return tuple(common)

    def weight_targets(self) -> list[Engine]:
        """Every member receives the weights, failed ones included (they may come back)."""
        return [t for e in self.engines for t in e.weight_targets()]

    def healthy_engines(self) -> list[int]:
        if self.config.recheck_failed:
            for i in sorted(self.failed):
                if self.engines[i].health():
                    self.failed.discard(i)
        return [i for i in range(len(self.engines)) if i not in self.failed]

    def generate(self, prompts: list[list[int]], params: SamplingParams, first_prompt_index: int = 0) -> list[Sample]:
        if not prompts:
            return []
        live = self.healthy_engines()
        if not live:
            raise PoolError(f"no healthy engine among {len(self.engines)}")
        per_job = self.config.prompts_per_job or -(-len(prompts) // len(live))
        todo: "queue.Queue[_Job]" = queue.Queue()
        jobs = [_Job(s, prompts[s:s + per_job]) for s in range(0, len(prompts), per_job)]
        for job in jobs:
            todo.put(job)
        results: dict[int, list[Sample]] = {}
        fatal: list[str] = []
        lock = threading.Lock()
        done = threading.Event()
        alive = {i: True for i in live}

        def work(i: int):
            engine = self.engines[i]
            while not done.is_set():
                try:
                    job = todo.get(timeout=0.05)
                except queue.Empty:
                    continue
                try:
                    out = engine.generate(job.prompts, params, first_prompt_index=first_prompt_index + job.start)
                    if len(out) != len(job.prompts) * params.n:
                        raise RuntimeError(f"returned {len(out)} samples for {len(job.prompts)} prompts x n={params.n}")
                except Exception as e:  # noqa: BLE001 - any engine failure sends the job elsewhere
                    job.attempts += 1
                    job.errors += (f"{engine!r}: {type(e).__name__}: {e}",)
                    with lock:
                        self.failed.add(i)
                        alive[i] = False
                        if job.attempts >= self.config.max_attempts or not any(alive.values()):
                            fatal.append(f"prompts {job.start}..{job.start + len(job.prompts) - 1} failed on "
                                         f"{job.attempts} engine(s): " + " | ".join(job.errors))
                            done.set()
                        else:
                            todo.put(job)
                    return  # this engine takes no more jobs in this call
                with lock:
                    results[job.start] = out
                    if len(results) == len(jobs):
                        done.set()

        threads = [threading.Thread(target=work, args=(i,), daemon=True, name=f"megaopd-pool-{i}") for i in live]
        for t in threads:
            t.start()
        if not done.wait(timeout=self.config.timeout_s):
            done.set()
            raise PoolError(f"generate did not finish in {self.config.timeout_s:.0f}s "
                            f"({len(results)}/{len(jobs)} jobs done)")
        if fatal:
            raise PoolError("; ".join(fatal))
        return [s for start in sorted(results) for s in results[start]]

    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        """Prompt log-probs from the first healthy engine that has them (all engines hold the same weights)."""
        errors = []
        for i in self.healthy_engines():
            fn = getattr(self.engines[i], "prompt_logprobs", None)
            if fn is None:
                continue
            try:
                return fn(prompt_ids)
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
