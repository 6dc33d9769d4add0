"""The rollout stage of a step: the batch from the rollout flow, part by part, each part given to every scorer
as it comes (megaopd.scoring.scorers), then the whole batch delivered to the ranks that use its rows and scored.

    generated = stage.generate(step, examples, golden)   # collective: parts -> scorers; then delivery
    scored = stage.score(generated, timer)               # collective: log pi_old and log q of the owned rows

RolloutFlow.parts hands on the batch whole, as one part, or (rollout.stream_parts > 1 in sync mode,
engines remote: RolloutFlow.streams) in parts as the engines return them: the same path either way. For
each part rank 0 builds its record, every rank gets its header (batching.delivery), the ranks of the passes
that score it now get its rows' tokens, and every scorer takes it: a served teacher asks its servers for its
rows at once (rank 0's threads), the actor's pass and the in-job teachers' score a part that is not the whole
batch at once, each DP replica its share (balanced by the part's own lengths: the owners are not known until
the whole batch is), so they hide behind the rest of the generation. Then the whole batch is delivered (its
owners known), and `score` runs what waited for it: the served teachers' rest in their threads, the actor's
pass (or the trip of its part scores to the owners), the in-job teachers' (which may score at the student's
top-k, the actor's result), and the served scores' trip to the owners.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch.distributed as dist

from megaopd.batching.delivery import broadcast_header, deliver_rows, row_users, scorer_users
from megaopd.batching.micro_batches import ScoringBatches
from megaopd.batching.owners import RowOwners
from megaopd.batching.settings import BatchingSettings
from megaopd.batching.shares import row_owners
from megaopd.parallel.dist import device as dist_device
from megaopd.rollout.protocol import Sample
from megaopd.rollout.records import RolloutBatch, TokenScores, build_rollout_batch
from megaopd.scoring.passes import ScoreRequest
from megaopd.scoring.scorers import BatchPart, PassScorer, Scorer, WholeBatch, in_order
from megaopd.scoring.teachers import TeacherScoring
from megaopd.trainer.roles import Models, on_gpu_while_used
from megaopd.trainer.rollout_flow import RolloutFlow, RolloutPart
from megaopd.trainer.timer import Timer

if TYPE_CHECKING:  # annotations only: config composes every package's section, so no package imports it
    from megaopd.config.schema import MegaOPDConfig
    from megaopd.losses.needs import LossNeeds


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """What every stage of a step reads and none changes, built once at start-up."""

    cfg: MegaOPDConfig
    models: Models
    needs: LossNeeds
    batching: BatchingSettings
    """The training step's micro-batches (and so the rows each actor replica owns)."""
    pad_id: int
    actor_request: ScoreRequest
    """What the actor's pass computes (log pi_old; the loss's and the overlap metrics' top-k, entropy)."""
    teacher_request: ScoreRequest


@dataclass(kw_only=True)
class Generated:
    """One step's batch as the rollout stage leaves it: delivered, every part given to the step's scorers."""

    samples: list[Sample] | None
    """The whole batch's samples, in row order (rank 0; None on the other ranks)."""
    whole: WholeBatch
    """This rank's record (every row's header, the token rows it trains or scores), the rows' owners (row_owners:
    the DP partition the micro-batches take) and the scoring passes' cut."""
    actor: PassScorer
    """The step's actor scorer (log pi_old, its top-k, entropy)."""
    teachers: list[Scorer]
    """The step's teacher scorers, in the order every rank runs them."""

    @property
    def batch(self) -> RolloutBatch:
        return self.whole.batch

    @property
    def owners(self) -> RowOwners:
        return self.whole.owners


@dataclass(frozen=True, kw_only=True)
class Scored:
    """A step's scores of this rank's owned rows."""

    actor: TokenScores
    """log pi_old (+ top-k, entropy)."""
    teacher: TokenScores | None
    """log q (+ top-K, entropy, log q at the student's top-k); None: no teacher."""
    served: ServedReport | None
    """The served teachers' work (None: none served)."""


@dataclass(frozen=True, kw_only=True)
class ServedReport:
    """Rank 0: what the served teachers did this step (every rank: seconds 0 elsewhere)."""

    seconds: float
    """Wall time of their scoring after the batch (their threads run together: the longest)."""
    rows: int
    """Rows with a response they scored."""
    part_rows: int
    """Of them, the rows scored part by part, as the batch arrived."""

    def log(self) -> dict[str, float]:
        """pipeline/teacher_streamed_fraction: the share of their rows scored while the batch generated."""
        return {"pipeline/teacher_streamed_fraction": self.part_rows / max(self.rows, 1)}


class RolloutStage:
    """Collective: generates, delivers and scores each step's batch (module docstring)."""

    def __init__(self, flow: RolloutFlow, context: StepContext):
        self.flow, self.context = flow, context

    def _scorers(self) -> tuple[PassScorer, list[Scorer]]:
        """The step's scorers (each holds one step's state): the actor's, and each teacher's in run order."""
        ctx = self.context
        models = ctx.models
        actor = PassScorer(
            name=None,
            runner=models.actor_runner,
            request=ctx.actor_request,
            layout=models.actor_layout,
            phase="actor_logprobs",
        )
        if models.teachers is None:
            return actor, []
        settings = TeacherScoring(
            request=ctx.teacher_request,
            at_ids=actor.result if ctx.teacher_request.at_ids else None,
            on_device=on_gpu_while_used,
        )
        return actor, in_order(models.teachers.scorers(settings))

    def generate(self, step: int, examples: list, golden=None) -> Generated:
        """Step `step`'s batch from its prompts `examples` (golden: the step's GoldenBatch, whose rows the
        owners balance too): every part to every scorer as it comes, then delivered whole."""
        actor, teachers = self._scorers()
        scorers = [*teachers, actor]
        by_row: dict[int, Sample] = {}
        header = None
        for part in self.flow.parts(step, examples):
            view = self._part(part, examples, scorers)
            for s in scorers:
                s.score_part(view)
            if part.samples is not None:
                by_row.update(zip(part.rows, part.samples))
            header = view.record if view.whole else None
        samples = [by_row[r] for r in range(len(by_row))] if self.flow.rank == 0 else None
        whole = deliver_rollout(self.context, samples, examples, golden, self.flow.stamp, scorers, header)
        return Generated(samples=samples, whole=whole, actor=actor, teachers=teachers)

    def score(self, generated: Generated, timer: Timer) -> Scored:
        """Collective: what waited for the whole batch, in the same order on every rank: the served teachers'
        threads started, the actor's scores, then the in-job teachers' and the served ones' routed."""
        whole, teachers = generated.whole, self.context.models.teachers
        whole.batch.check_held(whole.owners.rows(), "the actor's scoring pass")
        background = [s for s in generated.teachers if s.background]
        with timer("actor_logprobs"):
            for s in background:  # served teachers score on rank 0's threads while the actor scores below
                s.score_batch(whole)
            generated.actor.score_batch(whole)
            actor = generated.actor.finish(whole)
        if teachers is None:
            return Scored(actor=actor, teacher=None, served=None)
        with timer("teacher"):
            for s in generated.teachers:
                if not s.background:
                    s.score_batch(whole)
            teacher = teachers.merge(whole, {s.name: s.finish(whole) for s in generated.teachers})
        served = None
        if background:
            works = [s.work for s in background]
            served = ServedReport(
                seconds=max(w.seconds for w in works),
                rows=sum(w.rows for w in works),
                part_rows=sum(w.part_rows for w in works),
            )
        return Scored(actor=actor, teacher=teacher, served=served)

    def _part(self, part: RolloutPart, examples: list, scorers: list[Scorer]) -> BatchPart:
        """Collective: the part's record on every rank (its header; the tokens of its rows to the ranks of the
        passes that score it now)."""
        ctx, device = self.context, dist_device()
        n, rows, teachers = ctx.cfg.trainer.samples_per_prompt, part.rows, ctx.models.teachers
        record = broadcast_header(
            functools.partial(build_rollout_batch, part.samples, ctx.pad_id, n), ctx.pad_id, n, device
        )
        # Each teacher's rows of the part, routed as whole prompts (a part holds whole prompts).
        routed = teachers.route([examples[r // n].teacher for r in rows[::n]], n) if teachers is not None else {}
        view = BatchPart(
            rows=rows,
            record=record,
            batches=scoring_cut(ctx.cfg, record),
            teacher_rows=routed,
            whole=part.whole,
        )
        readers = [r for s in scorers for r in s.part_readers(view)]
        if readers:  # the same on every rank (pure in the lengths): each replica its share's tokens
            deliver_rows(record, scorer_users(len(rows), readers), device)
        return view


def scoring_cut(cfg: MegaOPDConfig, record: RolloutBatch) -> ScoringBatches:
    """How the scoring passes cut `record`'s rows into micro-batches (trainer.micro_batch_size, packing)."""
    t = cfg.trainer
    return ScoringBatches(
        t.micro_batch_size,
        t.max_tokens_per_micro_batch if t.pack_sequences else None,
        record.prompt_lens_B + record.response_lens_B,
    )


def deliver_rollout(
    context: StepContext,
    samples: list[Sample] | None,
    examples: list,
    golden,
    stamp: Callable[[RolloutBatch], None],
    scorers: Sequence[Scorer] = (),
    header: RolloutBatch | None = None,
) -> WholeBatch:
    """Collective: rank 0's samples as every rank's record, holding the rows the rank trains or scores
    (batching.delivery: the per-row header to every rank, then each row's tokens to its users), the rows'
    owners (row_owners: the DP partition the micro-batches take) and the scoring passes' cut. stamp: the
    rollout flow's, which writes each row's weight version; scorers: the step's, whose batch_readers read rows
    besides the owners; header: the batch's header already on every rank (the whole batch came as one part)."""
    cfg, models, pad_id = context.cfg, context.models, context.pad_id
    n, device = cfg.trainer.samples_per_prompt, dist_device()
    batch = header
    if batch is None:
        batch = broadcast_header(lambda: build_rollout_batch(samples, pad_id, n), pad_id, n, device)  # on rank 0
    stamp(batch)
    pgs = models.actor.pgs
    owners = RowOwners(
        tuple(row_owners(batch, golden, pgs.dp.size(), context.needs, context.batching)),
        pgs.dp.rank(),
        pgs.dp.size(),
        sends=models.owner_layout.places[dist.get_rank()].speaks,
        layout=models.owner_layout,
    )
    if models.teachers is not None:
        batch.teacher_rows = models.teachers.route([ex.teacher for ex in examples], n)
        batch.teacher_prefixes = models.teachers.prefixes(examples, n, batch.teacher_rows)
    whole = WholeBatch(batch=batch, owners=owners, batches=scoring_cut(cfg, batch))
    readers = [r for s in scorers for r in s.batch_readers(whole)]
    deliver_rows(batch, row_users(owners, models.owner_layout, readers), device)
    return whole
