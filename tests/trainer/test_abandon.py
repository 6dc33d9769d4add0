"""A preemption signal during the rollout flow's waits on the engines (megaopd.trainer.rollout_flow): the wait given up
on rank 0 is raised at the collective (WaitAbandoned), the step's batch is put back so the checkpoint's data
cursor is from before it, and an async sync whose pause was given up still pushes (the other ranks are in it)."""

import pytest

from megaopd.rollout.waits import WaitAbandoned
from tests.trainer.test_rollout_flow import Engine, _flow

pytestmark = pytest.mark.usefixtures("one_gloo_rank")  # the rollout flow calls torch.distributed


class StoppedEngine(Engine):
    """An engine whose waits were given up: every call after `stop_at` calls raises WaitAbandoned."""

    def __init__(self, stop_at=0, gen_s=0.0):
        super().__init__(gen_s)
        self.stop_at = stop_at

    def generate(self, prompts, params):
        if len(self.calls) >= self.stop_at:
            raise WaitAbandoned("POST /generate: abandoned, a stop was requested (preemption signal)")
        return super().generate(prompts, params)

    def pause(self, mode):
        if len(self.calls) >= self.stop_at:
            raise WaitAbandoned("POST /pause_generation: abandoned")
        super().pause(mode)


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_an_abandoned_rollout_puts_the_step_batch_back(mode):
    p, engine, trainer = _flow(mode, engine=StoppedEngine(stop_at=2))
    for step in range(2):
        trainer["step"] = step
        p.samples(step, p.examples(step))
        p.after_step(step + 1)
    before = p.state_dict()
    trainer["step"] = 2
    examples = p.examples(2)
    if mode == "sync":
        assert p.state_dict() != before  # handed out: a normal save after step 2 is past its batch
    with pytest.raises(WaitAbandoned):
        p.samples(2, examples)
    p.abandon(2)
    assert p.state_dict() == before  # the checkpoint of step 2 draws batch 2 again on resume
    assert p.examples(2)[0].prompt_ids == examples[0].prompt_ids


def test_an_abandoned_push_is_reported_by_after_step():
    p, engine, trainer = _flow("sync")

    def push(_version):
        raise WaitAbandoned("weight sync: abandoned")

    p.push = push
    p.samples(0, p.examples(0))
    assert p.after_step(1) is True and p.engine_version == 0


def test_an_async_sync_whose_pause_was_given_up_still_pushes():
    p, engine, trainer = _flow("async", max_staleness=2, engine=StoppedEngine(stop_at=3, gen_s=0.2))
    pushed = []
    p.push = lambda _version: pushed.append(trainer["step"])
    trainer["step"] = 0
    p.samples(0, p.examples(0))  # batches 1 and 2 go ahead
    p.ahead.wait(1)
    p.ahead.wait(2)
    engine.stop_at = 0  # the signal: the pause is given up, the push still runs (every rank is in it)
    p.ahead.submit(5, [], 0)  # something in flight, so the sync pauses
    p.ensure_synced(1)
    assert pushed == [0] and ("continue",) not in engine.log
