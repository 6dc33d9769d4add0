"""The rollout flow: where each step's prompts and samples come from, and when weights reach the engines
(rollout.mode). It owns the rollout engine, the weight sync to it, the version the engines hold and whether
the run is stopping. ("Flow", not "pipeline": the pipeline is megatron's pipeline parallelism, PipelineRunner;
the metrics keep their pipeline/* names, which metrics.jsonl's readers know.)

    sync          step k: draw prompts, generate under weights v_k, train -> v_k+1, sync v_k+1
    one_step_off  step k: take batch k (generated under v_k-1 while step k-1 trained), sync v_k (the
                  engine is idle: nothing to pause), submit batch k+1 under v_k, train on batch k
    async         as one_step_off with max_staleness = N batches in flight: batch k+N is submitted under
                  v_k; the sync of v_k pauses the in-flight ones (rollout.sync_pause) and they continue
                  under the new weights (partial rollouts: a response spans versions [first, last])

Every rank draws the same prompts at the same points (the loader is replicated); only rank 0 talks to the
engines (megaopd.rollout.overlap runs its generations in threads) and keeps the samples; every rank gets their
weight versions and the step's pipeline/* metrics (the trainer then sends each rank its rows: batching.delivery).
Validation first brings the engines to the trainer's weights (ensure_synced).

Checkpoints: the data cursor saved is the loader's before the earliest batch drawn ahead and not trained
(state_dict below), so a resumed run draws that batch again; the batch in flight at the save is lost and
regenerated on resume under the checkpoint's weights with its own seed (a lag of 0 for that one step).

Preemption: a signal gives rank 0's waits on the engines up (megaopd.rollout.waits: the engines' stop callback);
every collective that carries rank 0's engine work here (rank0_waits, the weight sync's barrier) then raises
WaitAbandoned on every rank at the same point, and abandon() puts the step's batch back, so the checkpoint the
trainer writes next keeps the cursor before it (the step in flight is not trained, and is drawn again on resume).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import threading
from dataclasses import dataclass, field
from queue import Queue
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from megaopd.parallel.dist import rank0_computes
from megaopd.rollout.overlap import GenerateAhead, StaleHandled, Taken, overlap_metrics, staleness
from megaopd.rollout.protocol import Sample, SamplingParams
from megaopd.rollout.trajectories import MultiTurn, generate_rows
from megaopd.rollout.waits import WaitAbandoned, rank0_waits
from megaopd.sync import WeightSync

if TYPE_CHECKING:  # annotations only: config composes every package's section, so no package imports it
    from megaopd.config.schema import MegaOPDConfig
    from megaopd.data import PromptLoader
    from megaopd.trainer.timer import Timer


@dataclass(frozen=True, kw_only=True)
class RolloutPart:
    """Rows of one step's batch, as the engines returned them (the whole batch, or a part while the rest
    generates: RolloutFlow.parts)."""

    rows: list[int]
    """Their batch rows, whole prompts' (every rank)."""
    samples: list[Sample] | None
    """Their samples, in the order of `rows` (rank 0; None on the other ranks)."""
    whole: bool = True
    """The batch came whole (not streamed): its passes wait for its owners. A streamed part is False even
    when it holds every row (parts that arrived together come as one)."""


@dataclass
class Received:
    """One step's samples (rank 0's; None on the others), their versions, the step's pipeline/* metrics."""

    samples: list[Sample] | None
    first_versions: list[int]
    metrics: dict[str, float]


@dataclass(frozen=True)
class FlowReport:
    """What the rollout flow tells the step's log about the batch it handed on (every rank)."""

    overlap: dict[str, float] = field(default_factory=dict)
    """The overlapped modes' pipeline/* (rollout.overlap.overlap_metrics: staleness, waits, dropped, ...)."""
    streamed_parts: int | None = None
    """The parts the batch came in when it streamed (rollout.stream_parts); None: it came whole."""

    def log(self) -> dict[str, float]:
        out = dict(self.overlap)
        if self.streamed_parts is not None:
            out["pipeline/streamed_parts"] = float(self.streamed_parts)  # parts scored as they came
        return out


@dataclass(frozen=True, kw_only=True)
class ActorWeights:
    """The actor's weights as the weight sync reads them: this rank's shards, their HF config, their groups."""

    model: object
    hf: object
    pgs: object


@dataclass(frozen=True, kw_only=True)
class EngineHooks:
    """What the rollout flow reads of the trainer (which owns the models) for its engine."""

    parity: Callable[[object], None]
    """parity(engine): the engine/actor parity check (collective; the engine on rank 0, None on the others)."""
    actor: ActorWeights | None = None
    """The weights the sync pushes (None: tests whose weight sync needs none)."""
    on_policy: bool = True
    """The steps generate (an SFT run's engine only validates, and gets the weights before it)."""


class RolloutFlow:
    def __init__(
        self,
        cfg: MegaOPDConfig,
        loader: PromptLoader,
        timer: Timer,
        stop_ids: Sequence[int],
        rank: int,
        hooks: EngineHooks,
        multi_turn: MultiTurn | None = None,
    ):
        """multi_turn: the environment loop when rollouts are trajectories (env.name set)."""
        self.multi_turn, self.actor, self.on_policy = multi_turn, hooks.actor, hooks.on_policy
        self.cfg, self.loader, self.timer, self.stop_ids, self.rank = cfg, loader, timer, list(stop_ids), rank
        self.parity = hooks.parity
        self.mode, self.max_staleness = cfg.rollout.mode, cfg.rollout.max_staleness
        self.depth = 0 if self.mode == "sync" else self.max_staleness  # batches generated ahead
        self.engine = None
        """The rollout engine (rank 0; None on the other ranks and when nothing generates): `attach` sets it."""
        self.weight_sync = None
        """The weight sync to `engine` (megaopd.sync.WeightSync), made with it."""
        self.engine_version = 0
        """Weight version the engines hold (every rank tracks it: syncs are collective)."""
        self.sent = [0, 0]
        """Rank 0: bytes the weight syncs sent since the last step's log, and of them the LoRA adapters' (sync_log)."""
        self.stopping = False
        """A preemption signal ended a wait on the engines, or the trainer's flag was raised (stop): the run saves
        and leaves after the current step. Set here only."""
        self.drawn: dict[int, list] = {}
        self._cursors: dict[int, dict] = {}  # the loader's state before each batch drawn ahead
        self._handed: tuple[int, dict, list] | None = None  # the last step examples() gave: abandon() takes it back
        self.ahead = GenerateAhead(self._generate) if rank == 0 and self.depth else None
        self.versions_B: list[int] | None = None
        self.report = FlowReport()
        """The last batch's (samples, parts)."""

    # ------------------------------------------------------------------------------------------- data
    def _draw(self, step: int) -> None:
        self._cursors[step] = copy.deepcopy(self.loader.state_dict())
        self.drawn[step] = self.loader.next_batch()

    def examples(self, step: int) -> list:
        """The prompts step `step` trains on (drawn now, or when its batch was submitted ahead)."""
        if step not in self.drawn:
            self._draw(step)
        self._handed = (step, self._cursors.pop(step), self.drawn.pop(step))
        return self._handed[2]

    def abandon(self, step: int) -> None:
        """Step `step` will not be trained (a preemption signal ended it): its batch counts as not drawn, so
        state_dict (the checkpoint's data cursor) is from before it; the run stops."""
        self.stopping = True
        if self._handed is not None and self._handed[0] == step:
            self._cursors[step], self.drawn[step] = self._handed[1], self._handed[2]

    def state_dict(self) -> dict:
        """The loader's state as a checkpoint keeps it: before the batches drawn ahead (module docstring)."""
        return self._cursors[min(self._cursors)] if self._cursors else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    # ---------------------------------------------------------------------------------------- samples
    def params(self, step: int) -> SamplingParams:
        r, t = self.cfg.rollout, self.cfg.trainer
        return SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            n=t.samples_per_prompt,
            stop_token_ids=self.stop_ids,
            seed=t.seed * 1_000_003 + step,
        )

    def _generate(self, step: int, examples: list, on_part: Callable | None = None) -> list[Sample]:
        """Rank 0: the engine's samples or trajectories of step `step` (then, colocated, its memory goes back to
        the actor). on_part(first_row, examples, samples): as each of rollout.stream_parts parts finishes."""
        samples = generate_rows(
            self.engine, examples, self.params(step), self.multi_turn, self.cfg.rollout.stream_parts, on_part
        )
        if self.cfg.rollout.colocated:
            self.engine.release_memory()  # the actor trains on these GPUs next
        return samples

    def samples(self, step: int, examples: list) -> list[Sample] | None:
        """Collective: the samples of step `step` (generated now, or taken from ahead) on rank 0, None on the
        other ranks (batching.delivery sends each its rows), and the versions and metrics on every rank."""
        if not self.depth:

            def generate() -> Received:
                samples = self._generate(step, examples)
                return Received(samples, [self.engine_version] * len(samples), {})

            got = self._received(generate)
            self.versions_B, self.report = got.first_versions, FlowReport(got.metrics)
            return got.samples
        if self.ahead is not None and not self.ahead.has(step):  # the first step, or the first after a resume
            self.ahead.submit(step, examples, self.engine_version)
        got = self._received(functools.partial(self._take, step))
        self.versions_B, self.report = got.first_versions, FlowReport(got.metrics)
        # Batch `step` is done: the weights it trains with go to the engines before the next batches start.
        self.ensure_synced(step)
        for s in range(step + 1, min(step + self.depth, self.cfg.trainer.max_steps - 1) + 1):
            if s not in self.drawn:
                self._draw(s)
                if self.ahead is not None:
                    self.ahead.submit(s, self.drawn[s], self.engine_version)
        return got.samples

    @property
    def streams(self) -> bool:
        """The batch comes in parts as it generates (rollout.stream_parts > 1 in sync mode, engines on devices
        of their own: the trainer's are free meanwhile; colocated engines hold part of their memory while they
        generate, and the overlapped modes already score one batch while the next generates)."""
        r = self.cfg.rollout
        return not self.depth and r.stream_parts > 1 and self.multi_turn is None and not r.colocated

    def parts(self, step: int, examples: list) -> Iterator[RolloutPart]:
        """Collective: step `step`'s batch as parts covering its rows once each, in the order rank 0 receives
        them: in parts as it generates when `streams` (the parts that came back since the last one was handed
        on, together), else the whole batch as one part (generated now or taken from ahead, as `samples`).
        After the last part the versions and the step's metrics are set on every rank."""
        if not self.streams:
            samples = self.samples(step, examples)
            yield RolloutPart(rows=list(range(len(self.versions_B))), samples=samples)
            return
        yield from self._stream(step, examples)

    def _stream(self, step: int, examples: list) -> Iterator[RolloutPart]:
        """Collective (`streams`): generates step `step`'s batch in parts (generate_rows, in a thread of rank 0)
        and yields them as they finish. An error of the generation is raised on every rank."""
        B = len(examples) * self.cfg.trainer.samples_per_prompt
        parts = _Parts(step, B)
        if self.rank == 0:

            def on_part(first_row, part_examples, samples):
                parts.queue.put(_Arrived(first_row, samples))

            def run():
                try:
                    parts.queue.put(_Generated(self._generate(step, examples, on_part)))
                except BaseException as e:  # noqa: BLE001 - raised on every rank by the loop below
                    parts.queue.put(_Failed(e))

            threading.Thread(target=run, daemon=True, name=f"megaopd-stream-{step}").start()
        seen = yielded = 0
        while seen < B:
            part = _raised_everywhere(parts.next)
            seen, yielded = seen + len(part.rows), yielded + 1
            yield part
        _raised_everywhere(parts.finish)
        self.versions_B = [self.engine_version] * B
        self.report = FlowReport(streamed_parts=yielded)

    def _received(self, make: Callable[[], Received]) -> Received:
        """make() on rank 0, everything but its samples on every rank (rank 0 keeps them); WaitAbandoned on every
        rank when make() gave a wait on the engines up (rank0_waits)."""
        kept = {}

        def on_rank0():
            got = kept["got"] = make()
            return dataclasses.replace(got, samples=None)

        got = rank0_waits(on_rank0)
        return kept.get("got", got)

    def _take(self, step: int) -> Received:
        """Rank 0: batch `step` from ahead, its too-stale samples dropped or regenerated, and its metrics."""
        taken = self.ahead.take(step)
        st = staleness(taken, step, self.max_staleness)
        handled = self._handle_stale(taken, st.stale_B, step)
        st = staleness(taken, step, self.max_staleness) if handled.regenerated else st  # regenerated: fresh
        metrics = overlap_metrics(taken, st, handled, self.max_staleness, self.ahead.read_idle())
        return Received(handled.samples, st.first_B, metrics)

    def _handle_stale(self, taken: Taken, stale_B: list[bool], step: int) -> StaleHandled:
        """rollout.stale_samples: drop (the row stays, with an empty response: nothing to learn from, as an
        aborted request) or regenerate under the engine's current weights. With the flow's own
        scheduling no sample exceeds max_staleness; this guards a slower engine or a changed schedule."""
        idx = [i for i, s in enumerate(stale_B) if s]
        samples = list(taken.samples)
        if not idx:
            return StaleHandled(samples=samples)
        if self.cfg.rollout.stale_samples == "drop":
            for i in idx:
                samples[i] = Sample(samples[i].prompt_ids, [], [], "abort", samples[i].weight_version)
            return StaleHandled(samples=samples, dropped=len(idx))
        params = self.params(step)
        params.n, params.seed = 1, params.seed + 7_919  # a fresh draw, not the stale sample again
        fresh = self.engine.generate([samples[i].prompt_ids for i in idx], params)
        for i, s in zip(idx, fresh):
            samples[i] = s
            taken.first_versions[i] = self.engine_version
        taken.samples = samples
        return StaleHandled(samples=samples, regenerated=len(idx))

    def stamp(self, batch) -> None:
        """The batch's weight versions (RolloutBatch.weight_versions_B: each row's first token's)."""
        import torch

        batch.weight_versions_B = torch.tensor(self.versions_B, dtype=torch.long)

    # ------------------------------------------------------------------------------------------- sync
    def ensure_synced(self, version: int, timed: bool = True) -> None:
        """Collective: the engines hold weights `version` (the trainer's step) after it. one_step_off waits
        for the batch in flight first (its samples keep their version); async pauses the in-flight requests
        for the transfer and lets them continue under the new weights."""
        if self.engine_version >= version:
            return
        pause = self.mode == "async" and self.ahead is not None and self.ahead.in_flight
        if self.ahead is not None and self.mode == "one_step_off":
            for s in self.ahead.in_flight:
                self.ahead.wait(s)
        with self.timer("sync") if timed else contextlib.nullcontext():
            # Rank 0 only (the others are in push): a pause given up still goes on to push(), whose requests then
            # end at once and whose barrier tells every rank (WaitAbandoned everywhere, together).
            paused = (
                pause
                and _given_up(lambda: [t.pause(self.cfg.rollout.sync_pause) for t in self.engine.weight_targets()])
                is None
            )
            try:
                self.push(version)
            finally:
                if paused:
                    _given_up(lambda: [t.continue_generation() for t in self.engine.weight_targets()])
            self.engine_version = version
            interval = self.cfg.rollout.parity_interval
            if interval and version % interval == 0:
                self._check_parity()

    def attach(self, engine, weight_sync=None) -> None:
        """Once at start-up: the rollout engine (rank 0; None on the other ranks) and the weight sync to it
        (default: megaopd.sync.WeightSync over the engine's transports; tests give their own)."""
        self.engine = engine
        self.weight_sync = weight_sync if weight_sync is not None else WeightSync(engine, self.cfg.rollout, self.rank)

    def push(self, version: int) -> None:
        """Collective: the actor's current weights, version `version`, to the engines."""
        a = self.actor
        stats = self.weight_sync.push(
            a.model if a else None, a.hf if a else None, a.pgs if a else None, weight_version=str(version)
        )
        if stats is not None:  # rank 0
            self.sent = [self.sent[0] + stats.bytes, self.sent[1] + stats.adapter_bytes]

    def sync_log(self) -> dict[str, float]:
        """Rank 0: sync/bytes and sync/adapter_bytes, what the weight syncs sent since the last call (the first
        step's include the start-up sync); a LoRA adapter sync's steady pushes send the adapters alone."""
        if self.engine is None:
            return {}
        out = {"sync/bytes": float(self.sent[0]), "sync/adapter_bytes": float(self.sent[1])}
        self.sent = [0, 0]
        return out

    def _check_parity(self) -> None:
        self.parity(self.engine)

    def first_sync(self, version: int) -> None:
        """Collective, at start-up: the engines get weights `version` and the parity probe checks them;
        `stopping` on every rank when a preemption signal ended its waits (nothing new to checkpoint: the run
        just leaves)."""
        given_up = _given_up(self.push, version) or _given_up(self._check_parity)
        self.engine_version = version
        self.stopping = self.stopping or given_up is not None

    def after_step(self, step: int) -> bool:
        """Collective, after the update that made weights `step`: sync mode pushes them now; the overlapped
        modes at the next batch's boundary (samples) or before validation (ensure_synced). True, and
        `stopping`, on every rank when a preemption signal ended the push (the step itself is complete:
        checkpoint it and leave)."""
        if not self.depth and not self.stopping:
            self.stopping = _given_up(self.ensure_synced, step, False) is not None  # in the trainer's "sync" block
        return self.stopping

    def stop(self, flagged: bool) -> None:
        """The trainer's preemption flag (all-reduced: the same on every rank): stop after this step."""
        self.stopping = self.stopping or flagged

    def validation_engine(self, version: int):
        """Collective: the engine (rank 0; None on the others) holding weights `version` for validation: SFT
        steps do not sync, so it gets them now; the overlapped modes sync at batch boundaries, so it may be
        behind."""
        if not self.on_policy:
            self.push(version)
        else:
            self.ensure_synced(version)
        return self.engine

    def until_given_up(self, fn: Callable[[], dict]) -> dict:
        """fn(), or {} with `stopping` set when a preemption signal ended one of its waits on the engines
        (WaitAbandoned, on every rank together)."""
        try:
            return fn()
        except WaitAbandoned:
            self.stopping = True
            return {}

    def close(self) -> None:
        """The engines' weight-update group goes with the run: a served engine outlives it, and the next run
        against it (or this one resumed) forms its own group of the same name."""
        if self.weight_sync is not None:
            self.weight_sync.close()


def _given_up(fn, *args) -> WaitAbandoned | None:
    """fn(*args); the WaitAbandoned it raised (a wait on the engines given up), None when it finished."""
    try:
        fn(*args)
    except WaitAbandoned as e:
        return e
    return None


@dataclass(frozen=True)
class _Arrived:
    """A part of the batch back from the engines: its samples, rows first_row.. of the batch."""

    first_row: int
    samples: list[Sample]


@dataclass(frozen=True)
class _Generated:
    """The generation ended: every sample of the batch."""

    samples: list[Sample]


@dataclass(frozen=True)
class _Failed:
    """The generation raised `error` (raised on every rank)."""

    error: BaseException


class _Parts:
    """Rank 0, RolloutFlow._stream: the parts of one batch as the generating threads put them in `queue`
    (_Arrived each, then _Generated or _Failed)."""

    def __init__(self, step: int, rows: int):
        self.queue: Queue[_Arrived | _Generated | _Failed] = Queue()
        self.step, self.rows, self.seen = step, rows, 0
        self.all: list[Sample] | None = None

    def next(self) -> RolloutPart:
        """Every part that came back since the last call, as one (when scoring is slower than the parts
        arrive, the passes take them in larger batches); the samples stay on rank 0 (None in what the other
        ranks receive)."""
        items = [self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        rows, samples = [], []
        for item in items:
            if isinstance(item, _Failed):
                raise item.error
            if isinstance(item, _Generated):
                self.all = item.samples
                if not self.seen and not rows:  # a batch too small to split comes back whole, as one part
                    rows, samples = list(range(len(item.samples))), list(item.samples)
            else:
                rows += range(item.first_row, item.first_row + len(item.samples))
                samples += item.samples
        self.seen += len(rows)
        if not rows or (self.all is not None and self.seen != self.rows):
            raise RuntimeError(f"step {self.step}: the engines returned {self.seen} of the batch's {self.rows} rows")
        return RolloutPart(rows=rows, samples=samples, whole=False)

    def finish(self) -> None:
        """After the last part: the generation ended, with the whole batch."""
        if self.all is None:
            item = self.queue.get()
            if isinstance(item, _Failed):
                raise item.error
            self.all = item.samples
        if len(self.all) != self.rows:
            got = len(self.all)
            raise RuntimeError(f"step {self.step}: the engines returned {got} of the batch's {self.rows} rows")


def _raised_everywhere(fn: Callable[[], RolloutPart | None]) -> RolloutPart | None:
    """fn() on rank 0, its result on every rank without rank 0's samples; what fn raised is raised on every rank
    (it travels to them in the broadcast: the one place an error is a value)."""
    kept = {}

    def on_rank0():
        try:
            got = kept["got"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised on every rank below
            return _Failed(e)
        return dataclasses.replace(got, samples=None) if got is not None else None

    out = rank0_computes(on_rank0)
    if isinstance(out, _Failed):
        raise out.error
    return kept.get("got", out)
