"""Every model that scores a step's responses behind one protocol: the actor's own pass (log pi_old), an in-job
teacher (any layout, with or without a view of its own) and a served teacher.

    scorers = [served..., actor, in-job teachers...]      # StepScoring.scorers: the order of their collectives
    for part in parts:                                    # as the rollout arrives; a whole batch is one part
        for s in scorers: s.score_part(part)              # a pass may score the part now, or wait for the batch
    for s in scorers: s.score_batch(whole)                # the batch delivered, its owners known
    scores = {s.name: s.finish(whole) for s in scorers}   # TokenScores of this rank's owned rows

A part comes whole (rollout.stream_parts 1, the overlapped modes) or as the engines return it (stream_parts > 1
in sync mode): the same calls either way. What changes is only when each scorer runs its forward:
- a pass in the job (`PassScorer`) scores a streamed part at once, each of its DP
  replicas its share of the part (StreamedPass, below), and sends the rows to their owners in
  `score_batch`; a batch that came whole (BatchPart.whole) it scores in `score_batch`, over the owned rows,
  which needs no routing. A pass
  that cannot score before the batch is in (the student's top-k scored at, a model parked in CPU memory between
  uses, a view of its own cut over the whole batch: `streams` False) scores in `score_batch` always;
- a served teacher (`ServedScorer`) asks its servers for a part's rows at once, in a thread of rank 0, and in
  `score_batch` for the rest (its views, rows whose part failed); `finish` joins and routes its scores from rank
  0 to the rows' owners.

Every method is collective over the world except where it says rank 0; every rank calls the scorers in the
same order.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Protocol, Sequence

import torch

from megaopd.batching.micro_batches import ScoringBatches
from megaopd.batching.owners import RowOwners, WorldLayout
from megaopd.batching.packing import row_lengths
from megaopd.data.teacher_view import TeacherPrompt
from megaopd.parallel.dist import device as group_device
from megaopd.parallel.dist import global_rank, holds_results, rank0_computes
from megaopd.parallel.exchange import pack_columns, route_rows, scatter_received, unpack_columns
from megaopd.rollout.records import LOGPROBS, SPANS, TOPK_IDS, TOPK_LOGPROBS, RolloutBatch, TokenScores
from megaopd.scoring.passes import ScoreRequest, assigned_micro_batches, forward_scores, score_tokens
from megaopd.scoring.routing import (
    RowRoutes,
    ScoringAssignment,
    is_aligned,
    scorer_layout,
    scoring_shares,
    send_to_owners,
)
from megaopd.scoring.runner import PipelineRunner
from megaopd.scoring.views import view_lengths, view_rows

Readers = tuple[list[list[int]], WorldLayout]
"""Who reads rows' tokens besides their owners: per DP replica of a model the rows it scores, and its layout."""


@dataclass(frozen=True, kw_only=True)
class BatchPart:
    """A part of one step's batch as the scorers get it (every rank; RolloutStage builds it)."""

    rows: list[int]
    """Its batch rows (whole prompts'), in record order."""
    record: RolloutBatch
    """The part's record: its header on every rank; the tokens of the rows a rank's passes read (every row on
    rank 0, which built it)."""
    batches: ScoringBatches
    """The part's cut for the passes."""
    teacher_rows: dict[str, list[int]]
    """Per teacher, the part's rows (0-based in the part) routed to it."""
    whole: bool
    """The batch came whole, as this one part (not streamed): a pass waits for its owners rather than route its
    scores to them, and a served teacher's early rows are not counted as scored while it generated."""

    def rows_for(self, teacher: str | None) -> list[int]:
        """The part rows (0-based) `teacher` scores (None: the actor, every row)."""
        return list(range(len(self.rows))) if teacher is None else self.teacher_rows.get(teacher, [])


@dataclass(frozen=True, kw_only=True)
class WholeBatch:
    """One step's batch delivered: what `score_batch` and `finish` read."""

    batch: RolloutBatch
    """This rank's record (its teacher_rows and teacher_prefixes set)."""
    owners: RowOwners
    """The actor replica that trains each row; each scorer's result holds this rank's owned rows."""
    batches: ScoringBatches
    """The whole batch's cut (each teacher takes its rows' subset)."""

    def rows_for(self, teacher: str | None) -> list[int]:
        """The batch rows `teacher` scores (None: the actor, every row)."""
        return list(range(self.batch.size)) if teacher is None else self.batch.teacher_rows.get(teacher, [])


class Scorer(Protocol):
    """One model's scores of a step's batch (module docstring). A scorer holds one step's state: a step makes
    its own (StepScoring.scorers)."""

    name: str | None
    """The teacher's name; None: the actor."""
    phase: str
    """The timer phase of its work after the batch (actor_logprobs, teacher)."""
    background: bool
    """score_batch only starts work in the background (served): run before the passes, it overlaps them."""

    def part_readers(self, part: BatchPart) -> list[Readers]:
        """Who must hold each part row's tokens before score_part (part rows, 0-based). Pure."""

    def score_part(self, part: BatchPart) -> None:
        """A part of the batch as it arrives."""

    def batch_readers(self, whole: WholeBatch) -> list[Readers]:
        """Who besides the owners must hold each batch row's tokens before score_batch. Pure given the layouts."""

    def score_batch(self, whole: WholeBatch) -> None:
        """The batch is in: the scoring that waited for it (served: started; in the job: run)."""

    def finish(self, whole: WholeBatch) -> TokenScores:
        """The scores of this rank's owned rows among those it scores (rows: batch rows)."""


def _no_device(_model, _offload) -> ContextManager:
    return contextlib.nullcontext()


@dataclass
class PassScorer:
    """A model of the job scoring its rows: the actor (every row) or an in-job teacher (the rows routed to it;
    with `prompt`, its own view of each)."""

    name: str | None
    runner: PipelineRunner
    request: ScoreRequest
    layout: WorldLayout | None = None
    """Its scorer_layout, gathered once at start-up (None: each pass gathers it)."""
    model: torch.nn.Module | None = None
    offload: bool = False
    """Parked in CPU memory between uses: `on_device` brings it in for each pass."""
    on_device: Callable[[torch.nn.Module, bool], ContextManager] = _no_device
    prompt: TeacherPrompt | None = None
    """How it makes its own sequence of a row (None: it reads the student's)."""
    at_ids: Callable[[], TokenScores | None] | None = None
    """The ids it scores at (the student's top-k: the actor scorer's result, as TokenScores of the owned rows)."""
    phase: str = "teacher"
    background = False
    """score_batch runs the pass (the served scorers, which only start threads there, go first)."""
    streams: bool = True
    """It may score parts as they arrive (module docstring: not with at_ids, offload or a view of its own)."""
    _stream: StreamedPass | None = field(default=None, init=False)
    _scored: list[int] = field(default_factory=list, init=False)
    _result: TokenScores | None = field(default=None, init=False)

    def __post_init__(self):
        self.streams = self.streams and self.at_ids is None and not self.offload and self.prompt is None

    def _streams(self, part: BatchPart) -> bool:
        return self.streams and not part.whole

    def _pass(self) -> StreamedPass:
        if self._stream is None:
            layout = self.layout or scorer_layout(self.runner.pgs, group_device())
            self._stream = StreamedPass(self.runner, self.request, layout)
        return self._stream

    def part_readers(self, part: BatchPart) -> list[Readers]:
        idx = part.rows_for(self.name)
        if not self._streams(part) or not idx:
            return []
        it = torch.tensor(idx, dtype=torch.long)
        stream = self._pass()
        shares = stream.part_shares(part.record.tokens_BS[it], part.batches.subset(it))
        return [([[idx[i] for i in share] for share in shares], stream.layout)]

    def score_part(self, part: BatchPart) -> None:
        idx = part.rows_for(self.name)
        if not self._streams(part) or not idx:
            return
        it = torch.tensor(idx, dtype=torch.long)
        with self._on_device():
            self._pass().score(part.record.tokens_BS[it], [part.rows[i] for i in idx], part.batches.subset(it))
        self._scored += [part.rows[i] for i in idx]

    def batch_readers(self, whole: WholeBatch) -> list[Readers]:
        rows = whole.rows_for(self.name)
        if self._stream is not None or not rows or self.name is None:  # the actor reads its owned rows
            return []
        batch, device = whole.batch, group_device()
        sub = whole.owners.subset(rows)
        layout = self.layout if self.layout is not None else scorer_layout(self.runner.pgs, device)
        if is_aligned(self.runner.pgs.dp.size(), sub, layout, sub.world_layout(device)):
            return []  # it scores the owned rows, which the owners hold
        prefixes = batch.teacher_prefixes.get(self.name)
        if prefixes is not None:  # it scores its own sequences: their lengths make its shares
            lengths = view_lengths(batch, rows, [prefixes[b] for b in rows])
        else:
            idx = torch.tensor(rows, dtype=torch.long)
            lengths = row_lengths(batch.tokens_BS[idx], whole.batches.subset(idx).lengths_B)
        packed = whole.batches.max_tokens is not None and self.runner.packs
        shares = scoring_shares(lengths, self.runner.pgs.dp.size(), packed, None)
        return [([[rows[i] for i in share] for share in shares], layout)]

    def score_batch(self, whole: WholeBatch) -> None:
        batch, owners = whole.batch, whole.owners
        if self._stream is not None:  # scored on the parts: to the owners now
            lengths = batch.prompt_lens_B + batch.response_lens_B
            scores = self._stream.finish(owners, owners.layout, lengths, batch.tokens_BS.shape[1])
            mine = set(self._scored)
            self._result = scores.take([b for b in owners.rows() if b in mine])
            return
        rows = whole.rows_for(self.name)
        if not rows:
            return
        idx = torch.tensor(rows, dtype=torch.long)
        sub = owners.subset(rows)
        sub_at = None
        at = self.at_ids() if self.at_ids is not None else None
        if at is not None:
            sub_at = at.topk_ids_BTK[at.index([rows[i] for i in sub.rows()])]
        prefixes = batch.teacher_prefixes.get(self.name) if self.name is not None else None
        view = None if prefixes is None else view_rows(batch, rows, [prefixes[b] for b in rows], self.prompt)
        if view is not None and sub_at is not None:
            sub_at = view.to_view(sub_at, sub.rows())
        with self._on_device():
            # Rows are independent (right padding, causal attention): a model scores its rows only.
            part = score_tokens(
                self.runner,
                batch.tokens_BS[idx] if view is None else view.tokens_BS,
                whole.batches.subset(idx) if view is None else view.batches(whole.batches),
                self.request,
                at_ids_BTK=sub_at,
                owners=sub,
                layout=self.layout,
            )
        if view is None:
            part.rows = [rows[i] for i in part.rows]  # sub-batch rows -> batch rows
        else:  # its positions -> the student's, sub-batch rows -> batch rows
            part = view.to_student(part, batch.tokens_BS.shape[1] - 1)
        self._result = part

    def finish(self, whole: WholeBatch) -> TokenScores:
        if self._result is None:  # no rows of this step
            T = whole.batch.tokens_BS.shape[1] - 1
            return TokenScores(logprobs_BT=torch.zeros(0, T), rows=[])
        return self._result

    def result(self) -> TokenScores | None:
        """What score_batch made (the actor's scores, for a teacher scoring at the student's top-k)."""
        return self._result

    def _on_device(self) -> ContextManager:
        return self.on_device(self.model, self.offload) if self.model is not None else contextlib.nullcontext()


@dataclass
class ServedWork:
    """Rank 0: a served teacher's scoring of one step's batch, in threads (nothing on the other ranks)."""

    part_threads: list[threading.Thread] = field(default_factory=list)
    part_scores: dict = field(default_factory=dict)
    """{batch row: (its sequence, PrefillScores)} of the rows scored part by part (RemoteTeacher.score_sequences)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None
    result: TokenScores | None = None
    error: BaseException | None = None
    seconds: float = 0.0
    """Wall time of the scoring after the batch (rank 0)."""
    rows: int = 0
    """Rows with a response it scored (rank 0)."""
    part_rows: int = 0
    """Of them, rows scored part by part while the batch generated (rank 0; a whole batch is not counted)."""
    streamed: bool = False
    """It was given parts that are not the whole batch (the batch streamed)."""


@dataclass
class ServedScorer:
    """A teacher served over HTTP (scoring.remote.RemoteTeacher): rank 0 asks its servers in threads, then sends
    each row's response positions to the row's owners."""

    name: str
    teacher: object
    """Its RemoteTeacher (score, score_sequences)."""
    topk: int
    """The top-K it gives."""
    prompt: TeacherPrompt | None = None
    """How it makes its own sequence of a row (None: it reads the student's)."""
    phase: str = "teacher"
    background = True
    """score_batch only starts a thread: it goes before the passes, which then overlap it."""
    work: ServedWork = field(default_factory=ServedWork)

    def part_readers(self, part: BatchPart) -> list[Readers]:
        return []  # rank 0, which built the part, holds every row

    def score_part(self, part: BatchPart) -> None:
        """Rank 0: asks for the part's rows at once (a view of its own waits for the batch: score_batch). A part
        that fails is not an error here: score_batch asks for its rows again, and raises if the servers still
        fail."""
        rows = part.rows_for(self.name)
        if global_rank() != 0 or not rows or self.prompt is not None:
            return
        rec = part.record
        p, r = rec.prompt_lens_B.tolist(), rec.response_lens_B.tolist()
        seqs = [rec.tokens_BS[i, : p[i] + r[i]].tolist() for i in rows]
        firsts = [p[i] for i in rows]
        batch_rows = [part.rows[i] for i in rows]
        work, t = self.work, self.teacher
        work.streamed = work.streamed or not part.whole

        def run():
            try:
                out = t.score_sequences(batch_rows, seqs, firsts, self.topk)
            except Exception as e:  # noqa: BLE001 - asked again (and a lasting error raised) by score_batch
                print(
                    f"[teacher {self.name}] scoring rows {batch_rows[0]}..{batch_rows[-1]} while generating failed "
                    f"({e}); they are scored after generation",
                    file=sys.stderr,
                    flush=True,
                )
                return
            with work.lock:
                work.part_scores.update(out)

        thread = threading.Thread(target=run, daemon=True, name=f"megaopd-teacher-{self.name}-{batch_rows[0]}")
        thread.start()
        work.part_threads.append(thread)

    def batch_readers(self, whole: WholeBatch) -> list[Readers]:
        return []

    def score_batch(self, whole: WholeBatch) -> None:
        """Rank 0: the rest in a thread (the actor's pass runs meanwhile)."""
        rows = whole.rows_for(self.name)
        if global_rank() != 0 or not rows:
            return
        batch, work, t = whole.batch, self.work, self.teacher

        def run():
            t0 = time.perf_counter()
            try:
                for thread in work.part_threads:
                    thread.join()
                prefixes = batch.teacher_prefixes.get(self.name)
                if prefixes is not None:  # its own sequences (never asked for part by part)
                    view = view_rows(batch, rows, [prefixes[b] for b in rows], self.prompt)
                    n_B = view.lengths_B - view.view_starts_B  # its response tokens (its own under cross)
                    scores = t.score(view.tokens_BS, view.view_starts_B, n_B, topk=0 if view.alignments else self.topk)
                    scores.rows = list(range(len(rows)))
                    work.result = view.to_student(scores, batch.tokens_BS.shape[1] - 1)
                else:
                    work.result = t.score(
                        batch.tokens_BS,
                        batch.prompt_lens_B,
                        batch.response_lens_B,
                        topk=self.topk,
                        rows=rows,
                        scored=work.part_scores,
                    )
                work.rows = sum(1 for b in rows if int(batch.response_lens_B[b]) > 0)
                work.part_rows = t.last_reused if work.streamed else 0
            except BaseException as e:  # noqa: BLE001 - raised on every rank by finish()
                work.error = e
            work.seconds = time.perf_counter() - t0

        work.thread = threading.Thread(target=run, daemon=True, name=f"megaopd-teacher-{self.name}")
        work.thread.start()

    def finish(self, whole: WholeBatch) -> TokenScores:
        """Rank 0's scores sent to each row's owners (every rank of the owning actor replica): one all_to_all
        (exchange.route_rows) of the response positions only, log-probs and top-K log-probs float32, top-K ids
        int32 bit for bit. Its error, if any, is raised on every rank."""
        batch, owners = whole.batch, whole.owners
        rows = whole.rows_for(self.name)
        T = batch.tokens_BS.shape[1] - 1
        if not rows:  # the same on every rank (routing is a pure function of the batch): nothing to wait for
            return TokenScores(logprobs_BT=torch.zeros(0, T), rows=[])
        work = self.work

        def collect():
            if work.thread is not None:
                work.thread.join()
            return work.error

        error = rank0_computes(collect)
        if error is not None:
            raise error
        device, me, K = group_device(), global_rank(), self.topk
        prompt_B, response_B = batch.prompt_lens_B.tolist(), batch.response_lens_B.tolist()
        # Row b's response tokens are predicted at positions p - 1 .. p + r - 2: only those r travel.
        spans = [range(p - 1, p - 1 + r) if r > 0 else range(0) for p, r in zip(prompt_B, response_B)]
        held_rows = sorted(rows)  # rank 0 holds them all
        layout = owners.world_layout(device)
        dests = [layout.replica(o) for o in owners.owner_B]
        fields = [LOGPROBS, TOPK_IDS, TOPK_LOGPROBS] if K else [LOGPROBS]  # what a served teacher gives
        if self.prompt is not None and self.prompt.cross:
            fields = [LOGPROBS, SPANS]  # a cross-tokenizer teacher's: span log-probs and span ids (no top-K)
        widths = [max(1, math.prod(f.trailing(K, 0))) for f in fields]
        payload = None
        if me == 0:
            scores = work.result
            cols: list[list[torch.Tensor]] = [[] for _ in fields]
            for b in held_rows:
                span = spans[b]
                i = b if scores.rows is None else int(scores.index([b])[0])  # a view's scores hold its rows
                for col, f, w in zip(cols, fields, widths):
                    col.append(score_field(scores, f)[i, span.start : span.stop].reshape(-1, w).to(f.dtype))
            payload = pack_columns([torch.cat(c) for c in cols]).to(device)
        held = [held_rows] + [[] for _ in range(len(layout.places) - 1)]
        counts, starts = [len(sp) for sp in spans], [sp.start for sp in spans]
        received, values = route_rows(payload, held, dests, counts, sum(widths), device)
        columns = unpack_columns(values, widths, [f.dtype for f in fields])
        mine = set(owners.rows())
        kept = [b for b in rows if b in mine]
        dense = {
            f.name: scatter_received(c, received, counts, kept, T, starts).reshape(len(kept), T, *f.trailing(K, 0))
            for f, c in zip(fields, columns)
        }
        return TokenScores(**dense, rows=kept)


def score_field(scores: TokenScores, f) -> torch.Tensor:
    """A score field of `scores`; a same-tokenizer teacher's missing spans are one span per token."""
    value = getattr(scores, f.name)
    if value is None and f is SPANS:
        B, T = scores.logprobs_BT.shape
        return torch.arange(T, dtype=torch.int32).expand(B, T).clone()
    return value


def in_order(scorers: Sequence[Scorer]) -> list[Scorer]:
    """The order every rank runs `scorers` in: those working in the background first (they overlap the
    passes), then the others as given."""
    return [s for s in scorers if s.background] + [s for s in scorers if not s.background]


@dataclass
class StreamedPass:
    """One model's pass over a batch's parts, as they come (PassScorer's, for parts that are not the whole batch).

    The owners of a row are not known while the batch generates (row_owners balances the whole batch over DP),
    so each part is shared over the model's DP replicas by its own lengths (`part_shares`: balanced by tokens
    and attention cost when packed, contiguous otherwise), scored, and kept on the share's speaker (TP rank 0 of
    the last stage). `finish` then routes every row's real positions to its owners in one all_to_all, as a
    teacher in another layout does after a whole-batch pass (routing.send_to_owners): the same values, only the
    time they are computed moves."""

    runner: PipelineRunner
    request: ScoreRequest
    layout: WorldLayout
    """The model's scorer_layout (who speaks for each of its DP replicas)."""
    shares: list[list[int]] = field(default_factory=list)
    """Per DP replica of the model, the batch rows it scored, in the order scored (part by part)."""
    local: list[TokenScores] = field(default_factory=list)
    """The speaker's scores of its replica's rows, one record per part that gave it rows ([rows, T_part])."""
    packed: bool = False

    def part_shares(self, tokens_BS: torch.Tensor, batches: ScoringBatches) -> list[list[int]]:
        """Per DP replica, the part rows (0-based in the part) it scores: a pure function of the lengths
        (batches.lengths_B; tokens_BS only for its shape), so the part's tokens can be sent to exactly these
        ranks first (batching.delivery)."""
        packed = batches.max_tokens is not None and self.runner.packs
        return scoring_shares(row_lengths(tokens_BS, batches.lengths_B), self.runner.pgs.dp.size(), packed, None)

    def score(self, tokens_BS: torch.Tensor, batch_rows: list[int], batches: ScoringBatches) -> None:
        """Scores a part: tokens_BS its rows [n, S_part] (this replica's share held), batch_rows the batch row
        of each, batches the part's cut."""
        pgs = self.runner.pgs
        self.packed = batches.max_tokens is not None and self.runner.packs
        lengths = row_lengths(tokens_BS, batches.lengths_B)
        shares = self.part_shares(tokens_BS, batches)
        S = tokens_BS.shape[1]
        assignment = ScoringAssignment(
            shares, pgs.dp.rank(), False, self.packed, lengths, [min(n, S) - 1 for n in lengths], S - 1
        )
        mbs = assigned_micro_batches(tokens_BS, None, assignment, batches, self.runner)
        local = forward_scores(
            self.runner, mbs, self.request, self.request.outputs(None), len(assignment.rows), assignment.T
        )
        self.shares = self.shares or [[] for _ in shares]
        for d, share in enumerate(shares):
            self.shares[d] += [batch_rows[i] for i in share]
        if local is not None:
            self.local.append(local)

    def finish(self, owners: RowOwners, owner_layout: WorldLayout, lengths_B: torch.Tensor, S: int) -> TokenScores:
        """The owned rows' scores (one all_to_all of the real positions from each share's speaker)."""
        pgs, device = self.runner.pgs, group_device()
        T = S - 1
        outputs = self.request.outputs(None)
        lengths = [max(1, int(n)) for n in lengths_B.tolist()]
        self.shares = self.shares or [[] for _ in range(pgs.dp.size())]  # no part gave this model rows
        assignment = ScoringAssignment(
            self.shares, pgs.dp.rank(), False, self.packed, lengths, [min(n, S) - 1 for n in lengths], T
        )
        local = None
        if self.local:  # parts padded to the batch's T, in the order their rows were scored (assignment.rows)
            local = TokenScores(
                **{f.name: torch.cat([_pad_T(getattr(p, f.name), T) for p in self.local]) for f in outputs.fields}
            )
        speaks = holds_results(pgs)
        routes = RowRoutes(owners=owners, scorers=self.layout, owner_layout=owner_layout)
        return send_to_owners(local, assignment, outputs, routes, speaks, device)


def _pad_T(x: torch.Tensor, T: int) -> torch.Tensor:
    """[rows, t, ...] -> [rows, T, ...], zeros after t."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, T - x.shape[1]))
