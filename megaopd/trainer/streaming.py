"""In-job scoring while the batch generates (rollout.stream_parts > 1 in rollout.mode sync, engines remote):
the actor's pass (log pi_old, top-k, entropy) and the in-job teachers' run on each part of the batch as the
engines return it, so they hide behind the rest of the generation instead of following it.

    streamed = stream_and_score(pipeline, step, examples, cfg, models, needs, actor_request, teacher_request,
                                pad_id, on_device)                # every rank, collective, part by part
    batch, owners, batches = deliver_rollout(streamed.samples, ...)   # the whole batch, as without streaming
    batch.actor = streamed.actor_scores(batch, owners, owner_layout)  # the parts' scores to their owners
    batch.teacher = teachers.score(..., streamed=streamed.teacher_scores(batch, owners, owner_layout))

Each part: rank 0 builds its record, every rank gets its header (batching.delivery), each model's DP
replicas score their share of it (balanced by the part's own lengths: the owners are not known until the
whole batch is) after one all_to_all brings them its rows' tokens. Served teachers stream as before
(TeacherSet.stream_part, from the generating thread). A teacher that scores at the student's top-k (LSM's
student support) needs the actor's whole pass first, and one parked in CPU memory between uses would move
once a part: they score after the batch, unstreamed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, ContextManager

import torch

from megaopd.batching.delivery import broadcast_header, deliver_rows, scorer_users
from megaopd.batching.micro_batches import ScoringBatches
from megaopd.batching.owners import RowOwners, WorldLayout
from megaopd.parallel.dist import device as dist_device
from megaopd.rollout.protocol import Sample
from megaopd.rollout.records import RolloutBatch, TokenScores, build_rollout_batch
from megaopd.scoring.passes import ScoreRequest
from megaopd.scoring.routing import scorer_layout
from megaopd.scoring.streaming import StreamedPass
from megaopd.scoring.teachers import InJobTeacher


@dataclass
class Streamed:
    """One batch generated in parts, scored part by part."""

    samples: list[Sample] | None
    """The whole batch's samples (rank 0; None on the other ranks)."""
    actor: StreamedPass
    teachers: dict[str, StreamedPass]
    """The in-job teachers that scored their rows part by part, by name."""
    rows_of: dict[str, list[int]]
    """The batch rows each of them scored."""

    def actor_scores(self, batch: RolloutBatch, owners: RowOwners, owner_layout: WorldLayout) -> TokenScores:
        """The actor's scores of this rank's owned rows."""
        return self.actor.finish(
            owners, owner_layout, batch.prompt_lens_B + batch.response_lens_B, batch.tokens_BS.shape[1]
        )

    def teacher_scores(
        self, batch: RolloutBatch, owners: RowOwners, owner_layout: WorldLayout
    ) -> dict[str, TokenScores]:
        """Per streamed teacher, its scores of this rank's owned rows among those it scored (TeacherSet.score's
        parts)."""
        out = {}
        for name, stream in self.teachers.items():
            scores = stream.finish(
                owners, owner_layout, batch.prompt_lens_B + batch.response_lens_B, batch.tokens_BS.shape[1]
            )
            mine = set(self.rows_of[name])
            out[name] = scores.take([b for b in owners.rows() if b in mine])
        return out


def stream_and_score(
    pipeline,
    step: int,
    examples: list,
    cfg,
    models,
    needs,
    actor_request: ScoreRequest,
    teacher_request: ScoreRequest,
    pad_id: int,
    on_device: Callable[[torch.nn.Module, bool], ContextManager] | None = None,
) -> Streamed:
    """Collective: generates step `step`'s batch in parts (RolloutPipeline.stream) and scores each part with the
    actor and the in-job teachers as it comes (see the module docstring)."""
    on_device = on_device or (lambda _m, _o: contextlib.nullcontext())
    n, t, device = cfg.trainer.samples_per_prompt, cfg.trainer, dist_device()
    max_tokens = t.max_tokens_per_micro_batch if t.pack_sequences else None
    actor = StreamedPass(models.actor_runner, actor_request, models.actor_layout)
    teachers = models.teachers
    # Not streamed: a teacher scoring at the student's top-k (it needs the actor's whole pass) and one parked
    # in CPU memory between uses (it would move in and out once a part).
    in_job = {
        name: tch
        for name, tch in (teachers.teachers.items() if teachers is not None else [])
        if isinstance(tch, InJobTeacher) and not needs.student_topk and not tch.offload
    }
    passes = {
        name: StreamedPass(tch.runner, teacher_request, tch.layout or scorer_layout(tch.runner.pgs, device))
        for name, tch in in_job.items()
    }
    rows_of: dict[str, list[int]] = {name: [] for name in passes}
    for rows, samples in pipeline.stream(step, examples):
        part = broadcast_header(partial(build_rollout_batch, samples, pad_id, n), pad_id, n, device)
        batches = ScoringBatches(t.micro_batch_size, max_tokens, part.prompt_lens_B + part.response_lens_B)
        routed = teachers.route([examples[r // n].teacher for r in rows[::n]], n) if passes else {}  # whole prompts
        work = [(actor, None, list(range(len(rows))))] + [(passes[m], in_job[m], routed.get(m, [])) for m in passes]
        work = [(stream, tch, idx, torch.tensor(idx, dtype=torch.long)) for stream, tch, idx in work if idx]
        scorers = [
            (
                [[idx[i] for i in share] for share in stream.part_shares(part.tokens_BS[it], batches.subset(it))],
                stream.layout,
            )
            for stream, _, idx, it in work
        ]
        deliver_rows(part, scorer_users(len(rows), scorers), device)  # each replica its share's tokens
        for stream, tch, idx, it in work:
            with on_device(tch.model, tch.offload) if tch is not None else contextlib.nullcontext():
                stream.score(part.tokens_BS[it], [rows[i] for i in idx], batches.subset(it))
        for name in passes:
            rows_of[name] += [rows[i] for i in routed.get(name, [])]
    return Streamed(pipeline.streamed_samples, actor, passes, rows_of)
