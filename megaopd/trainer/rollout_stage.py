"""The rollout stage of a step: the batch from the rollout pipeline, part by part, each part scored as it comes by
the in-job passes that can run before the whole batch is in, then the whole batch delivered to the ranks that
use its rows.

    generated = stage.generate(step, examples, golden)   # collective: parts -> passes; then delivery
    batch.actor = stage.actor_scores(generated)          # log pi_old of this rank's owned rows
    batch.teacher = teachers.score(..., streamed=stage.teacher_scores(generated))

RolloutPipeline.parts hands on the batch whole, as one part, or (rollout.stream_parts > 1 in sync mode,
engines remote: RolloutPipeline.streams) in parts as the engines return them. While parts come, the actor's
pass (log pi_old, top-k, entropy) and the in-job teachers' run on each (scoring.streaming.StreamedPass), so
they hide behind the rest of the generation instead of following it: rank 0 builds the part's record, every
rank gets its header (batching.delivery), each model's DP replicas score their share of it (balanced by the
part's own lengths: the owners are not known until the whole batch is) after one all_to_all brings them its
rows' tokens. A whole batch needs no such pass: its owners are known once it is delivered, and the actor
scores its owned rows then (score_tokens), as the teachers do in TeacherSet.score. Served teachers score each
part from the generating thread (TeacherSet.stream_part, `served_teachers_on_part`). A teacher that scores at
the student's top-k (LSM's student support) needs the actor's whole pass first, and one parked in CPU memory
between uses would move once a part, and one that reads a sequence of its own (teacher.context, tokenizer own)
scores its views of the whole batch: they score after the batch.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Collection

import torch
import torch.distributed as dist

from megaopd.batching.delivery import broadcast_header, deliver_rows, row_users, scorer_users
from megaopd.batching.micro_batches import ScoringBatches
from megaopd.batching.owners import RowOwners
from megaopd.batching.plan import BatchingPlan
from megaopd.batching.shares import row_owners
from megaopd.parallel.dist import device as dist_device
from megaopd.rollout.protocol import Sample
from megaopd.rollout.records import RolloutBatch, TokenScores, build_rollout_batch
from megaopd.scoring.passes import ScoreRequest, score_tokens
from megaopd.scoring.routing import scorer_layout
from megaopd.scoring.streaming import StreamedPass
from megaopd.scoring.teachers import InJobTeacher, TeacherSet
from megaopd.trainer.pipeline import RolloutPart, RolloutPipeline
from megaopd.trainer.roles import Models, on_gpu_while_used

if TYPE_CHECKING:  # annotations only: config composes every package's section, so no package imports it
    from megaopd.config.schema import MegaOPDConfig
    from megaopd.losses.registry import LossNeeds


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """What every stage of a step reads and none changes, built once at start-up."""

    cfg: MegaOPDConfig
    models: Models
    needs: LossNeeds
    batching: BatchingPlan
    """The training step's micro-batches (and so the rows each actor replica owns)."""
    pad_id: int
    actor_request: ScoreRequest
    """What the actor's pass computes (log pi_old; the loss's and the overlap metrics' top-k, entropy)."""
    teacher_request: ScoreRequest


@dataclass
class PartPasses:
    """The in-job passes run on each part of a batch as it comes (none when the batch comes whole)."""

    actor: StreamedPass | None = None
    teachers: dict[str, StreamedPass] = field(default_factory=dict)
    """By name, the in-job teachers that score their rows part by part."""
    rows_of: dict[str, list[int]] = field(default_factory=dict)
    """The batch rows each of them scored."""


@dataclass(kw_only=True)
class Generated:
    """One step's batch as the rollout stage leaves it: delivered, and scored where its parts were."""

    samples: list[Sample] | None
    """The whole batch's samples, in row order (rank 0; None on the other ranks)."""
    batch: RolloutBatch
    """This rank's record: every row's header, the token rows it trains or scores."""
    owners: RowOwners
    """The actor replica that trains each row (row_owners: the DP partition the micro-batches take)."""
    batches: ScoringBatches
    """The whole batch's cut for the scoring passes."""
    passes: PartPasses


class RolloutStage:
    """Collective: generates and delivers each step's batch, scoring its parts as they come (module docstring)."""

    def __init__(self, pipeline: RolloutPipeline, context: StepContext):
        self.pipeline, self.context = pipeline, context

    def generate(self, step: int, examples: list, golden=None) -> Generated:
        """Step `step`'s batch from its prompts `examples` (golden: the step's GoldenBatch, whose rows the
        owners balance too): every part through the passes that stream, then delivered whole."""
        passes = self._part_passes() if self.pipeline.streams else PartPasses()
        by_row: dict[int, Sample] = {}
        for part in self.pipeline.parts(step, examples):
            self._score_part(passes, part, examples)
            if part.samples is not None:
                by_row.update(zip(part.rows, part.samples))
        samples = [by_row[r] for r in range(len(by_row))] if self.pipeline.rank == 0 else None
        batch, owners, batches = deliver_rollout(
            self.context, samples, examples, golden, self.pipeline.stamp, skip_teachers=passes.teachers
        )
        return Generated(samples=samples, batch=batch, owners=owners, batches=batches, passes=passes)

    def actor_scores(self, generated: Generated) -> TokenScores:
        """The actor's scores (log pi_old, its top-k, entropy) of this rank's owned rows: those its pass made of
        the parts, sent to their owners; or, of a whole batch, its pass over the owned rows now."""
        batch, owners, models = generated.batch, generated.owners, self.context.models
        if generated.passes.actor is not None:
            return generated.passes.actor.finish(owners, models.owner_layout, _lengths(batch), batch.tokens_BS.shape[1])
        return score_tokens(
            models.actor_runner,
            batch.tokens_BS,
            generated.batches,
            self.context.actor_request,
            owners=owners,
            layout=models.actor_layout,
        )

    def teacher_scores(self, generated: Generated) -> dict[str, TokenScores]:
        """Per teacher whose pass ran on the parts, its scores of this rank's owned rows among those it scored
        (TeacherSet.score runs the others)."""
        batch, owners, out = generated.batch, generated.owners, {}
        for name, stream in generated.passes.teachers.items():
            scores = stream.finish(owners, self.context.models.owner_layout, _lengths(batch), batch.tokens_BS.shape[1])
            mine = set(generated.passes.rows_of[name])
            out[name] = scores.take([b for b in owners.rows() if b in mine])
        return out

    def _part_passes(self) -> PartPasses:
        """The actor's pass, and the in-job teachers' that need nothing of the whole batch: not a teacher
        scoring at the student's top-k (it needs the actor's whole pass), nor one parked in CPU memory
        between uses (it would move in and out once a part), nor one reading a sequence of its own (its view
        rows are cut and mapped back over the whole batch: scoring.views)."""
        ctx = self.context
        teachers = ctx.models.teachers
        in_job = {
            name: tch
            for name, tch in (teachers.teachers.items() if teachers is not None else [])
            if isinstance(tch, InJobTeacher)
            and not ctx.needs.student_topk
            and not tch.offload
            and name not in teachers.prompts
        }
        return PartPasses(
            actor=StreamedPass(ctx.models.actor_runner, ctx.actor_request, ctx.models.actor_layout),
            teachers={
                name: StreamedPass(
                    tch.runner, ctx.teacher_request, tch.layout or scorer_layout(tch.runner.pgs, dist_device())
                )
                for name, tch in in_job.items()
            },
            rows_of={name: [] for name in in_job},
        )

    def _score_part(self, passes: PartPasses, part: RolloutPart, examples: list) -> None:
        """Collective: the part's record on every rank (its header; each pass's replicas its rows' tokens), each
        pass over its share of the part's rows. Nothing when no pass streams."""
        if passes.actor is None:
            return
        ctx, device = self.context, dist_device()
        t, n = ctx.cfg.trainer, ctx.cfg.trainer.samples_per_prompt
        rows, teachers = part.rows, ctx.models.teachers
        record = broadcast_header(
            functools.partial(build_rollout_batch, part.samples, ctx.pad_id, n), ctx.pad_id, n, device
        )
        batches = ScoringBatches(
            t.micro_batch_size,
            t.max_tokens_per_micro_batch if t.pack_sequences else None,
            record.prompt_lens_B + record.response_lens_B,
        )
        # Each teacher's rows of the part, routed as whole prompts (a part holds whole prompts).
        routed = teachers.route([examples[r // n].teacher for r in rows[::n]], n) if passes.teachers else {}
        work = [(passes.actor, None, list(range(len(rows))))]
        work += [(stream, teachers.teachers[name], routed.get(name, [])) for name, stream in passes.teachers.items()]
        work = [(stream, tch, idx, torch.tensor(idx, dtype=torch.long)) for stream, tch, idx in work if idx]
        scorers = [
            (
                [[idx[i] for i in share] for share in stream.part_shares(record.tokens_BS[it], batches.subset(it))],
                stream.layout,
            )
            for stream, _, idx, it in work
        ]
        deliver_rows(record, scorer_users(len(rows), scorers), device)  # each replica its share's tokens
        for stream, tch, idx, it in work:
            with on_gpu_while_used(tch.model, tch.offload) if tch is not None else contextlib.nullcontext():
                stream.score(record.tokens_BS[it], [rows[i] for i in idx], batches.subset(it))
        for name in passes.teachers:
            passes.rows_of[name] += [rows[i] for i in routed.get(name, [])]


def deliver_rollout(
    context: StepContext,
    samples: list[Sample] | None,
    examples: list,
    golden,
    stamp: Callable[[RolloutBatch], None],
    skip_teachers: Collection[str] = (),
) -> tuple[RolloutBatch, RowOwners, ScoringBatches]:
    """Collective: rank 0's samples as every rank's record, holding the rows the rank trains or scores
    (batching.delivery: the per-row header to every rank, then each row's tokens to its users), the rows'
    owners (row_owners: the DP partition the micro-batches take) and the scoring passes' cut. stamp: the
    pipeline's, which writes each row's weight version; skip_teachers: in-job teachers that scored their rows
    already (on the parts), which need none now."""
    cfg, models, pad_id = context.cfg, context.models, context.pad_id
    n, t, device = cfg.trainer.samples_per_prompt, cfg.trainer, dist_device()
    batch = broadcast_header(lambda: build_rollout_batch(samples, pad_id, n), pad_id, n, device)  # built on rank 0
    stamp(batch)
    pgs = models.actor.pgs
    owners = RowOwners(
        tuple(row_owners(batch, golden, pgs.dp.size(), context.needs, context.batching)),
        pgs.dp.rank(),
        pgs.dp.size(),
        sends=models.owner_layout.places[dist.get_rank()].speaks,
        layout=models.owner_layout,
    )
    batches = ScoringBatches(
        t.micro_batch_size,
        t.max_tokens_per_micro_batch if t.pack_sequences else None,
        batch.prompt_lens_B + batch.response_lens_B,
    )
    scorers = []
    if models.teachers is not None:
        batch.teacher_rows = models.teachers.route([ex.teacher for ex in examples], n)
        batch.teacher_prefixes = models.teachers.prefixes(examples, n, batch.teacher_rows)
        scorers = models.teachers.scorer_shares(batch, batch.teacher_rows, batches, owners, skip=skip_teachers)
    deliver_rows(batch, row_users(owners, models.owner_layout, scorers), device)
    return batch, owners, batches


def served_teachers_on_part(
    cfg: MegaOPDConfig, teachers: TeacherSet | None, rank: int, topk: int
) -> Callable[[int, int, list, list[Sample]], None] | None:
    """The pipeline's on_part: with rollout.stream_parts > 1, rank 0 hands each part that finished generating to
    the served teachers (TeacherSet.stream_part), in every rollout.mode; None when there are none to hand it to."""
    if rank != 0 or teachers is None or not teachers.has_remote or cfg.rollout.stream_parts <= 1:
        return None
    return functools.partial(teachers.stream_part, samples_per_prompt=cfg.trainer.samples_per_prompt, topk=topk)


def _lengths(batch: RolloutBatch) -> torch.Tensor:
    return batch.prompt_lens_B + batch.response_lens_B
