"""rollout.mode (megaopd.trainer.rollout_flow, megaopd.rollout.overlap) with a scripted engine in one process:
which weights generate each batch, that the next batch generates while the trainer trains, where syncs
and pauses land, the checkpoint's data cursor and resume, and too-stale samples dropped or regenerated."""

import threading
import time
from dataclasses import dataclass

import pytest

from megaopd.config.schema import MegaOPDConfig
from megaopd.rollout.config import RolloutConfig
from megaopd.rollout.protocol import Sample
from megaopd.trainer.rollout_flow import EngineHooks, RolloutFlow
from megaopd.trainer.timer import Timer

URL = ["http://127.0.0.1:1"]


pytestmark = pytest.mark.usefixtures("one_gloo_rank")  # the code under test calls torch.distributed


@dataclass
class Ex:
    prompt_ids: list


class Loader:
    """A cursor over prompts [0], [1], ...: prompt id = the batch's index in draw order."""

    def __init__(self, cursor=0):
        self.cursor = cursor

    def next_batch(self):
        self.cursor += 1
        return [Ex([self.cursor - 1])]

    def state_dict(self):
        return {"cursor": self.cursor}

    def load_state_dict(self, state):
        self.cursor = state["cursor"]


class Engine:
    """Answers each prompt with n samples tagged with the weights it holds; takes `gen_s` per call."""

    def __init__(self, gen_s=0.0):
        self.version, self.gen_s, self.calls, self.log = 0, gen_s, [], []

    def generate(self, prompts, params):
        start, version = time.perf_counter(), self.version
        time.sleep(self.gen_s)
        self.calls.append((prompts[0][0], params.seed, version, start, time.perf_counter()))
        return [Sample(list(p), [1, 2], [-0.1, -0.2], "stop", str(version)) for p in prompts for _ in range(params.n)]

    def weight_targets(self):
        return [self]

    def pause(self, mode):
        self.log.append(("pause", mode))

    def continue_generation(self):
        self.log.append(("continue",))


def _flow(mode="one_step_off", max_staleness=1, max_steps=6, gen_s=0.0, loader=None, engine=None, **rollout):
    cfg = MegaOPDConfig()
    cfg.rollout = RolloutConfig(engine="remote", urls=URL, mode=mode, max_staleness=max_staleness, **rollout)
    cfg.trainer.max_steps, cfg.trainer.samples_per_prompt = max_steps, 2
    engine = engine or Engine(gen_s)
    trainer = {"step": 0}

    class Sync:  # the weight sync: the "trainer's" weights (its step) to the engine
        def push(self, *_actor, weight_version):
            engine.log.append(("push", trainer["step"]))
            engine.version = trainer["step"]

    p = RolloutFlow(cfg, loader or Loader(), Timer(), [0], 0, EngineHooks(parity=lambda _engine: None))
    p.attach(engine, Sync())
    return p, engine, trainer


def _run(p, trainer, steps, start=0, train_s=0.0):
    out = []
    for step in range(start, start + steps):
        trainer["step"] = step
        examples = p.examples(step)
        samples = p.samples(step, examples)
        out.append((examples[0].prompt_ids[0], list(p.versions_B), p.report.log(), samples))
        time.sleep(train_s)  # "training"
    return out


def test_sync_mode_generates_now_under_the_current_weights():
    p, engine, trainer = _flow("sync")
    for step in range(3):
        ((prompt, versions, metrics, _),) = _run(p, trainer, 1, start=step)
        assert prompt == step and versions == [step] * 2 and metrics == {}
        trainer["step"] = step + 1
        p.after_step(step + 1)  # the trainer's end-of-step sync
    assert [c[2] for c in engine.calls] == [0, 1, 2] and [e[1] for e in engine.log] == [1, 2, 3]


def test_a_batch_not_streamed_is_one_part_of_every_row():
    """RolloutFlow.parts: without rollout.stream_parts the step's batch is one RolloutPart, its rows the
    whole batch, its samples samples()' own (the rollout stage takes both the same way)."""
    for mode in ("sync", "one_step_off"):
        p, _, trainer = _flow(mode)
        examples = p.examples(0)
        (part,) = list(p.parts(0, examples))
        assert part.rows == [0, 1] and [s.output_ids for s in part.samples] == [
            s.output_ids for s in _flow(mode)[0].samples(0, examples)
        ]


def test_one_step_off_trains_on_batches_one_version_old_while_the_next_generates():
    p, engine, trainer = _flow("one_step_off", gen_s=0.15)
    out = _run(p, trainer, 4, train_s=0.15)
    assert [o[0] for o in out] == [0, 1, 2, 3]  # the same prompts, in the same order, as sync
    assert [o[1] for o in out] == [[0, 0], [0, 0], [1, 1], [2, 2]]  # generated under the previous step's weights
    assert [o[2]["pipeline/staleness_max"] for o in out] == [0, 1, 1, 1]
    assert out[2][2]["pipeline/tokens_lag_1"] == 4.0 and out[2][2]["pipeline/tokens_lag_0"] == 0.0
    # Seeds are the step's, as in sync mode: the same samples given the same weights.
    p.ahead.wait(4)  # batch 4 is in flight
    assert [c[1] for c in engine.calls] == [p.params(s).seed for s in range(5)]
    # Pushes land between batches (the engine idle) and never pause anything.
    assert [e for e in engine.log if e[0] != "push"] == [] and [e[1] for e in engine.log] == [1, 2, 3]
    # Batch k+1 started before "training" on batch k ended: generation overlapped training.
    starts = {c[0]: c[3] for c in engine.calls}
    assert starts[2] < starts[3] - 0.1
    assert out[3][2]["pipeline/trainer_wait_s"] < 0.1  # generation and training take as long: little waiting


def test_no_batch_is_submitted_past_max_steps():
    p, engine, trainer = _flow("one_step_off", max_steps=3)
    _run(p, trainer, 3)
    assert [c[0] for c in engine.calls] == [0, 1, 2] and not p.ahead.in_flight


def test_async_keeps_max_staleness_batches_in_flight_and_pauses_them_for_syncs():
    p, engine, trainer = _flow("async", max_staleness=2, max_steps=8, gen_s=0.05, sync_pause="retract")
    out = _run(p, trainer, 5, train_s=0.02)
    assert [o[1][0] for o in out] == [0, 0, 0, 1, 2]  # batch k is submitted under v_(k-2)
    assert max(o[2]["pipeline/staleness_max"] for o in out) == 2
    assert ("pause", "retract") in engine.log and ("continue",) in engine.log
    i = engine.log.index(("pause", "retract"))
    assert engine.log[i + 1][0] == "push" and engine.log[i + 2] == ("continue",)


def test_checkpoint_cursor_excludes_the_batch_in_flight_and_resume_regenerates_it():
    p, engine, trainer = _flow("one_step_off")
    full = _run(p, trainer, 4)
    p, _, trainer = _flow("one_step_off")
    _run(p, trainer, 2)  # trained steps 0, 1; batch 2 was drawn and is in flight
    state = p.state_dict()
    assert state == {"cursor": 2}  # before batch 2's draw: a resume draws it again
    # Resume at step 2 (the in-flight batch is lost): drawn again, generated now under the checkpoint's weights.
    engine2 = Engine()
    engine2.version = 2
    loader = Loader()
    loader.load_state_dict(state)
    p2, _, trainer2 = _flow("one_step_off", loader=loader, engine=engine2)
    p2.engine_version = 2
    resumed = _run(p2, trainer2, 2, start=2)
    assert [r[0] for r in resumed] == [f[0] for f in full[2:]]  # the same prompts as the uninterrupted run
    assert resumed[0][1] == [2, 2] and resumed[0][2]["pipeline/staleness_max"] == 0  # lag 0 for that step
    assert resumed[1][1] == [2, 2]  # then one step off again
    assert engine2.calls[0][1] == p.params(2).seed  # with step 2's seed


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_too_stale_samples_are_dropped_or_regenerated(policy):
    p, engine, trainer = _flow("async", max_staleness=1, stale_samples=policy)
    engine.version = p.engine_version = 5
    p.ahead.submit(5, [Ex([9])], version=2)  # a batch three versions behind the weights of step 5
    got = p._take(5)
    if policy == "drop":
        assert all(s.output_ids == [] and s.finish_reason == "abort" for s in got.samples)
        assert got.metrics["pipeline/dropped"] == 2.0 and got.metrics["pipeline/regenerated"] == 0.0
    else:
        assert all(s.weight_version == "5" for s in got.samples) and got.first_versions == [5, 5]
        assert got.metrics["pipeline/regenerated"] == 2.0


def test_overlap_needs_engines_beside_the_trainer():
    with pytest.raises(ValueError, match="embedded engine runs in trainer rank 0's process"):
        RolloutConfig(mode="one_step_off")
    with pytest.raises(ValueError, match="colocated engines release their memory"):
        RolloutConfig(engine="remote", urls=URL, colocated=True, mode="async")
    with pytest.raises(ValueError, match="lags exactly one weight version"):
        RolloutConfig(engine="remote", urls=URL, mode="one_step_off", max_staleness=2)
    with pytest.raises(ValueError, match="rollout.mode='overlap'"):
        RolloutConfig(engine="remote", urls=URL, mode="overlap")
    with pytest.raises(ValueError, match="max_staleness=0"):
        RolloutConfig(engine="remote", urls=URL, mode="async", max_staleness=0)
    RolloutConfig(engine="remote", urls=URL, mode="async", max_staleness=3, stale_samples="regenerate")
    assert threading.active_count() >= 1


def test_the_parity_hook_gets_the_flows_engine_at_its_interval():
    """After every rollout.parity_interval-th sync the flow calls EngineHooks.parity with its own engine (a
    regression: ensure_synced once called the hook without it)."""
    p, engine, trainer = _flow("sync", parity_interval=2)
    seen = []
    p.parity = lambda e: seen.append((trainer["step"], e))
    for step in range(4):
        trainer["step"] = step
        p.samples(step, p.examples(step))
        trainer["step"] = step + 1
        p.after_step(step + 1)
    assert seen == [(2, engine), (4, engine)]
