"""spread_jobs, the one request-spreading loop of the rollout pool and the served teachers: results in job
order whoever ran them, a failed worker's job moves on, max_attempts, a refused job fails at once, timeouts."""

import time

import pytest

from megaopd.rollout.pool import SpreadError, SpreadRules, spread_jobs


class Worker:
    def __init__(self, name, fail=False, hang=False):
        self.name, self.fail, self.hang, self.ran = name, fail, hang, []

    def __repr__(self):
        return self.name


def call(worker, job):
    if worker.hang:
        time.sleep(30)
    if worker.fail:
        raise ConnectionError(f"{worker.name} is down")
    worker.ran.append(job)
    time.sleep(0.01)
    return job * 10


def test_results_in_job_order_and_failed_worker_skipped():
    good, bad, other = Worker("good"), Worker("bad", fail=True), Worker("other")
    failed = []
    out = spread_jobs(
        [good, bad, other], list(range(9)), call, SpreadRules(timeout_s=10, on_worker_failed=failed.append)
    )
    assert out == [j * 10 for j in range(9)]
    assert sorted(good.ran + other.ran) == list(range(9))  # every job once, the bad worker's moved on
    assert failed == [1]


def test_every_worker_failing_is_one_failure_with_each_error():
    workers = [Worker("a", fail=True), Worker("b", fail=True)]
    with pytest.raises(SpreadError) as e:
        spread_jobs(workers, [0], call, SpreadRules(timeout_s=10))  # one job: tried on each in turn
    assert not e.value.timed_out and e.value.failures
    f = e.value.failures[0]
    assert f.attempts == 2 and not f.refused
    assert sorted(f.errors) == ["a: ConnectionError: a is down", "b: ConnectionError: b is down"]


def test_max_attempts_and_refused():
    with pytest.raises(SpreadError) as e:
        spread_jobs(
            [Worker("a"), Worker("b"), Worker("c")],
            [0],
            call=lambda w, j: (_ for _ in ()).throw(ConnectionError("down")),
            rules=SpreadRules(timeout_s=10, max_attempts=1),
        )
    assert e.value.failures[0].attempts == 1  # c was never asked

    with pytest.raises(SpreadError) as e:
        spread_jobs(
            [Worker("a"), Worker("b")],
            [0],
            call=lambda w, j: (_ for _ in ()).throw(ValueError("bad")),
            rules=SpreadRules(timeout_s=10, refuse=(ValueError,), label=lambda w: f"<{w.name}>"),
        )
    f = e.value.failures[0]
    assert f.refused and f.attempts == 1 and f.worker in ("<a>", "<b>") and str(f.error) == "bad"


def test_timeout_is_an_error_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(SpreadError) as e:
        spread_jobs([Worker("slow", hang=True)], [0, 1], call, SpreadRules(timeout_s=0.3))
    assert e.value.timed_out and (e.value.done, e.value.total) == (0, 2)
    assert time.monotonic() - t0 < 5
    assert spread_jobs([Worker("a")], [], call, SpreadRules(timeout_s=1)) == []
