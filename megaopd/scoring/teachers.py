"""The job's teachers, in the job or served, and the routing of every sample to one of them.

    teachers = TeacherSet([InJobTeacher("math", runner, model, offload), RemoteTeacher("code", urls)])
    rows_of = teachers.route([ex.teacher for ex in examples], samples_per_prompt)  # name -> batch rows
    pending = teachers.start_remote(batch, rows_of, topk)         # rank 0: served teachers score in a thread
    batch.actor = score_tokens(...)                                # ... while the actor scores log pi_old
    batch.teacher = teachers.score(batch, rows_of, pending, ...)   # in-job teachers, then the served ones'

Each sample is scored by the teacher of its prompt's data source (data.sources[].teacher; with one teacher,
all of them): an in-job teacher runs score_tokens (megaopd.scoring.passes, collective over the world) on its
rows only, a served teacher (megaopd.scoring.remote) scores its rows over HTTP from rank 0, started before the
actor's own pass so the two overlap; afterwards rank 0 sends each of its rows' response positions to the
row's owners only (one all_to_all, parallel/exchange.py), as an in-job teacher's pass does. The per-teacher
results are written into one TokenScores of this rank's owned rows (RowOwners: the rows its actor replica
trains), row by row: the losses see one record, whoever scored it. A field is kept only when every teacher
produced it (entropy: in-job teachers only).

A teacher with a view of its own (teacher.context / tokenizer: `prompts`) scores its own sequence of each row
(megaopd.scoring.views: its prefix of the row, then the response) and its scores are moved back to the
student's positions before the routing and the merge: nothing downstream knows.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, ContextManager, Sequence

import torch

from megaopd.batching.micro_batches import ScoringBatches
from megaopd.batching.owners import RowOwners, WorldLayout
from megaopd.batching.packing import row_lengths
from megaopd.data.teacher_view import TeacherPrompt
from megaopd.parallel.dist import device as group_device
from megaopd.parallel.dist import global_rank, rank0_computes
from megaopd.parallel.exchange import pack_columns, route_rows, scatter_received, unpack_columns
from megaopd.rollout.records import (
    LOGPROBS,
    SCORE_FIELDS,
    SPANS,
    TOPK_IDS,
    TOPK_LOGPROBS,
    RolloutBatch,
    TokenScores,
)
from megaopd.scoring.passes import ScoreRequest, score_tokens
from megaopd.scoring.remote import RemoteTeacher
from megaopd.scoring.routing import is_aligned, scorer_layout, scoring_shares
from megaopd.scoring.runner import PipelineRunner
from megaopd.scoring.views import view_lengths, view_rows


@dataclass
class InJobTeacher:
    """A Megatron teacher inside the job (its stage on this rank and its runner)."""

    name: str
    runner: PipelineRunner
    model: torch.nn.Module
    offload: bool = False
    """Park in CPU memory between uses (GPU only; the caller's `on_device` context does the moves)."""
    layout: WorldLayout | None = None
    """Its scorer_layout, gathered once at start-up (None: each pass gathers it)."""


Teacher = InJobTeacher | RemoteTeacher


@dataclass
class PendingRemote:
    """Served teachers' scoring running in a thread on rank 0 (nothing on the other ranks)."""

    thread: threading.Thread | None = None
    results: dict[str, TokenScores] = field(default_factory=dict)
    error: BaseException | None = None
    seconds: float = 0.0
    """Wall time of the remote scoring (rank 0)."""
    topk: int = 0
    """The top-K the served teachers give (every rank: the width of what their scores' routing carries)."""
    rows: int = 0
    """Rank 0: rows the served teachers score this step."""
    streamed_rows: int = 0
    """Rank 0: of them, rows scored while the batch generated (rollout.stream_parts)."""


@dataclass
class StreamedScores:
    """Rank 0: served teachers' scoring of one batch's parts, each started as the part finished generating
    (rollout.stream_parts), while the rest of the batch still generated."""

    threads: list[threading.Thread] = field(default_factory=list)
    results: dict[str, dict] = field(default_factory=dict)
    """Teacher name -> {batch row: (its sequence, PrefillScores)} (RemoteTeacher.score_sequences)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def join(self) -> dict[str, dict]:
        for t in self.threads:
            t.join()
        return self.results


class TeacherSet:
    """Named teachers and the routing of samples to them (the same object on every rank)."""

    def __init__(self, teachers: Sequence[Teacher], prompts: dict[str, TeacherPrompt] | None = None):
        if not teachers:
            raise ValueError("TeacherSet needs at least one teacher")
        self.teachers = {t.name: t for t in teachers}
        if len(self.teachers) != len(teachers):
            raise ValueError(f"teacher names must be distinct: {[t.name for t in teachers]}")
        self.prompts = dict(prompts or {})
        """The teachers that read a sequence of their own (teacher.context / tokenizer), by name: how each
        makes its prefix of a row. The others score the student's own sequence."""
        unknown = [n for n in self.prompts if n not in self.teachers]
        if unknown:
            raise ValueError(f"teacher prompts for {unknown}, which are not among the teachers {self.names}")
        self._streamed: dict[int, StreamedScores] = {}
        self._streamed_lock = threading.Lock()

    def stream_part(
        self, step: int, first_row: int, examples: Sequence, samples: Sequence, samples_per_prompt: int, topk: int
    ) -> None:
        """Rank 0, from the thread that generated the part: the served teachers start scoring rows first_row..
        of step `step`'s batch (samples: prompt-major, n per prompt, of the part's data rows `examples`). A
        part that fails is not an error here: start_remote scores its rows again, and raises if the servers
        still fail."""
        rows_of = self.route([ex.teacher for ex in examples], samples_per_prompt)
        with self._streamed_lock:
            streamed = self._streamed.setdefault(step, StreamedScores())
        for name, rows in rows_of.items():
            t = self.teachers[name]
            # A teacher reading a sequence of its own is asked for its views after the batch (start_remote).
            if not isinstance(t, RemoteTeacher) or not rows or name in self.prompts:
                continue
            seqs = [list(samples[i].prompt_ids) + list(samples[i].output_ids) for i in rows]
            firsts = [len(samples[i].prompt_ids) for i in rows]
            batch_rows = [first_row + i for i in rows]

            def run(t=t, batch_rows=batch_rows, seqs=seqs, firsts=firsts):
                try:
                    out = t.score_sequences(batch_rows, seqs, firsts, topk)
                except Exception as e:  # noqa: BLE001 - scored again (and a lasting error raised) by start_remote
                    print(
                        f"[teacher {t.name}] scoring rows {batch_rows[0]}..{batch_rows[-1]} while generating failed "
                        f"({e}); they are scored after generation",
                        file=sys.stderr,
                        flush=True,
                    )
                    return
                with streamed.lock:
                    streamed.results.setdefault(t.name, {}).update(out)

            thread = threading.Thread(target=run, daemon=True, name=f"megaopd-stream-{name}-{step}-{first_row}")
            thread.start()
            streamed.threads.append(thread)

    def take_streamed(self, step: int) -> StreamedScores | None:
        """Rank 0: what stream_part started for step `step` (None when nothing was streamed)."""
        with self._streamed_lock:
            for old in [s for s in self._streamed if s < step]:  # batches never trained (a resume): dropped
                del self._streamed[old]
            return self._streamed.pop(step, None)

    @property
    def names(self) -> list[str]:
        return list(self.teachers)

    @property
    def has_remote(self) -> bool:
        return any(isinstance(t, RemoteTeacher) for t in self.teachers.values())

    def route(self, prompt_teachers: Sequence[str], samples_per_prompt: int) -> dict[str, list[int]]:
        """Batch rows (prompt-major: prompt i's samples are rows i*n .. i*n + n - 1) of each teacher, from the
        teacher name of each prompt; an empty name means the one teacher of a one-teacher job."""
        rows: dict[str, list[int]] = {name: [] for name in self.teachers}
        for i, name in enumerate(prompt_teachers):
            if not name:
                if len(self.teachers) > 1:
                    raise ValueError(
                        f"prompt {i} names no teacher and the job has several {self.names}: set data.sources[].teacher"
                    )
                name = self.names[0]
            if name not in rows:
                raise ValueError(f"prompt {i} routes to teacher {name!r}, not among {self.names}")
            rows[name].extend(range(i * samples_per_prompt, (i + 1) * samples_per_prompt))
        return rows

    def prefixes(
        self, examples: Sequence, samples_per_prompt: int, rows_of: dict[str, list[int]]
    ) -> dict[str, list[list[int]]]:
        """Per teacher with a view of its own, each batch row's prefix in its ids (a list per batch row; the
        rows of other teachers empty): pure in the data rows, so every rank computes the same (the lengths of
        the teachers' sequences, and so their scoring shares, follow from them)."""
        out = {}
        for name, prompt in self.prompts.items():
            rows = rows_of.get(name, [])
            if not rows:
                continue
            per_prompt: dict[int, list[int]] = {}
            prefix: list[list[int]] = [[] for _ in range(len(examples) * samples_per_prompt)]
            for b in rows:
                i = b // samples_per_prompt
                if i not in per_prompt:
                    per_prompt[i] = prompt.prefix_ids(examples[i])
                prefix[b] = per_prompt[i]
            out[name] = prefix
        return out

    # ------------------------------------------------------------------------------------------ scoring
    def start_remote(
        self,
        batch: RolloutBatch,
        rows_of: dict[str, list[int]],
        topk: int,
        rank: int,
        streamed: StreamedScores | None = None,
    ) -> PendingRemote:
        """Rank 0: starts the served teachers' scoring in a background thread (they wait on HTTP, so the
        actor's pass runs meanwhile); every other rank gets an empty PendingRemote. streamed: the rows
        already scored while the batch generated (take_streamed); only the others are asked for."""
        pending = PendingRemote(topk=topk)
        remote = [t for t in self.teachers.values() if isinstance(t, RemoteTeacher) and rows_of.get(t.name)]
        if rank != 0 or not remote:
            return pending

        def run():
            t0 = time.perf_counter()
            try:
                done = streamed.join() if streamed is not None else {}
                for t in remote:
                    prefixes = batch.teacher_prefixes.get(t.name)
                    if prefixes is not None:  # its own sequences (never streamed: stream_part leaves them)
                        rows = rows_of[t.name]
                        view = view_rows(batch, rows, [prefixes[b] for b in rows], self.prompts[t.name])
                        n_B = view.lengths_B - view.view_starts_B  # its response tokens (its own under cross)
                        scores = t.score(view.tokens_BS, view.view_starts_B, n_B, topk=0 if view.alignments else topk)
                        scores.rows = list(range(len(rows)))
                        pending.results[t.name] = view.to_student(scores, batch.tokens_BS.shape[1] - 1)
                    else:
                        pending.results[t.name] = t.score(
                            batch.tokens_BS,
                            batch.prompt_lens_B,
                            batch.response_lens_B,
                            topk=topk,
                            rows=rows_of[t.name],
                            scored=done.get(t.name),
                        )
                    # rows with a response (the ones scored), and of them the ones scored while generating
                    pending.rows += sum(1 for b in rows_of[t.name] if int(batch.response_lens_B[b]) > 0)
                    pending.streamed_rows += t.last_reused
            except BaseException as e:  # noqa: BLE001 - re-raised on every rank by score()
                pending.error = e
            pending.seconds = time.perf_counter() - t0

        pending.thread = threading.Thread(target=run, daemon=True, name="megaopd-remote-teachers")
        pending.thread.start()
        return pending

    def scorer_shares(
        self,
        batch: RolloutBatch,
        rows_of: dict[str, list[int]],
        batches: ScoringBatches,
        owners: RowOwners,
        skip: Collection[str] = (),
    ) -> list[tuple[list[list[int]], WorldLayout]]:
        """Per in-job teacher in a layout other than the owners', the batch rows each of its DP replicas scores
        in `score` and its layout: who besides the owners reads each row's tokens (batching.delivery). Pure
        given the layouts (a teacher without a gathered layout gathers it: collective). skip: teachers that
        scored already (streamed: `score` does not run their passes)."""
        device = group_device()
        out = []
        for name, t in self.teachers.items():
            rows = rows_of.get(name, [])
            if not isinstance(t, InJobTeacher) or not rows or name in skip:
                continue
            sub = owners.subset(rows)
            layout = t.layout if t.layout is not None else scorer_layout(t.runner.pgs, device)
            if is_aligned(t.runner.pgs.dp.size(), sub, layout, sub.world_layout(device)):
                continue  # it scores the owned rows, which the owners hold
            idx = torch.tensor(rows, dtype=torch.long)
            prefixes = batch.teacher_prefixes.get(name)
            if prefixes is not None:  # it scores its own sequences: their lengths make its shares
                lengths = view_lengths(batch, rows, [prefixes[b] for b in rows])
            else:
                lengths = row_lengths(batch.tokens_BS[idx], batches.subset(idx).lengths_B)
            packed = batches.max_tokens is not None and t.runner.packs
            shares = scoring_shares(lengths, t.runner.pgs.dp.size(), packed, None)
            out.append(([[rows[i] for i in share] for share in shares], layout))
        return out

    def score(
        self,
        batch: RolloutBatch,
        rows_of: dict[str, list[int]],
        pending: PendingRemote,
        batches: ScoringBatches,
        request: ScoreRequest,
        at_ids: TokenScores | None = None,
        on_device: Callable[[torch.nn.Module, bool], ContextManager] | None = None,
        owners: RowOwners | None = None,
        streamed: dict[str, TokenScores] | None = None,
    ) -> TokenScores:
        """The teacher scores of this rank's owned rows (owners.rows(); None: every row), each row from its
        routed teacher. Collective over the world (in-job teachers' passes, each routing its rows to their
        owners, then rank 0's served teachers' results routed to their owners the same way). batches: the
        cut of the whole batch (each teacher takes its rows' subset); request: what the in-job teachers
        compute (served ones give what start_remote asked). at_ids: the ids to score at (the student's top-k)
        as TokenScores-like rows (its topk_ids_BTK holds them for at_ids.rows). streamed: in-job teachers'
        scores already made while the batch generated (megaopd.trainer.rollout_stage), by name: their passes are
        not run again."""
        on_device = on_device or (lambda _m, _o: contextlib.nullcontext())
        owners = owners if owners is not None else RowOwners.replicated(batch.size, global_rank())
        parts: dict[str, TokenScores] = dict(streamed or {})
        for name, t in self.teachers.items():
            rows = rows_of.get(name, [])
            if not isinstance(t, InJobTeacher) or not rows or name in parts:
                continue
            idx = torch.tensor(rows, dtype=torch.long)
            sub = owners.subset(rows)
            sub_at = None
            if at_ids is not None:
                sub_at = at_ids.topk_ids_BTK[at_ids.index([rows[i] for i in sub.rows()])]
            prefixes = batch.teacher_prefixes.get(name)
            view = None if prefixes is None else view_rows(batch, rows, [prefixes[b] for b in rows], self.prompts[name])
            if view is not None and sub_at is not None:
                sub_at = view.to_view(sub_at, sub.rows())
            with on_device(t.model, t.offload):
                # Rows are independent (right padding, causal attention): a teacher scores its rows only.
                part = score_tokens(
                    t.runner,
                    batch.tokens_BS[idx] if view is None else view.tokens_BS,
                    batches.subset(idx) if view is None else view.batches(batches),
                    request,
                    at_ids_BTK=sub_at,
                    owners=sub,
                    layout=t.layout,
                )
            if view is None:
                part.rows = [rows[i] for i in part.rows]  # sub-batch rows -> batch rows
            else:  # its positions -> the student's, sub-batch rows -> batch rows
                part = view.to_student(part, batch.tokens_BS.shape[1] - 1)
            parts[name] = part
        parts.update(self._route_remote(batch, rows_of, pending, owners))
        return self._merge(batch, owners.rows(), parts)

    def wait_remote(self, pending: PendingRemote) -> None:
        """Rank 0 joins the thread; its error (if any) is raised on every rank. Collective (a small object
        broadcast); the scores stay on rank 0."""

        def collect():
            if pending.thread is not None:
                pending.thread.join()
            return pending.error

        error = rank0_computes(collect)
        if error is not None:
            raise error

    def _route_remote(
        self, batch: RolloutBatch, rows_of: dict[str, list[int]], pending: PendingRemote, owners: RowOwners
    ) -> dict[str, TokenScores]:
        """The served teachers' scores, held by rank 0, sent to each row's owners (every rank of the owning
        actor replica): one all_to_all (exchange.route_rows) of the response positions only, log-probs and
        top-K log-probs float32, top-K ids int32 bit for bit. Per served teacher, the TokenScores of this
        rank's owned rows it scored. Collective over the world."""
        served = {
            name: rows_of[name]
            for name, t in self.teachers.items()
            if isinstance(t, RemoteTeacher) and rows_of.get(name)
        }
        if not served:  # the same on every rank (routing is a pure function of the batch): nothing to wait for
            return {}
        self.wait_remote(pending)
        device = group_device()
        me = global_rank()
        K = pending.topk
        prompt_B, response_B = batch.prompt_lens_B.tolist(), batch.response_lens_B.tolist()
        T = batch.tokens_BS.shape[1] - 1
        # Row b's response tokens are predicted at positions p - 1 .. p + r - 2: only those r travel.
        spans = [range(p - 1, p - 1 + r) if r > 0 else range(0) for p, r in zip(prompt_B, response_B)]
        held_rows = sorted(b for rows in served.values() for b in rows)  # rank 0 holds them all
        layout = owners.world_layout(device)
        dests = [layout.replica(o) for o in owners.owner_B]
        fields = [LOGPROBS, TOPK_IDS, TOPK_LOGPROBS] if K else [LOGPROBS]  # what a served teacher gives
        if any(self.prompts.get(name) is not None and self.prompts[name].cross for name in served):
            fields = [LOGPROBS, SPANS]  # a cross-tokenizer teacher's: span log-probs and span ids (no top-K)
        widths = [max(1, math.prod(f.trailing(K, 0))) for f in fields]
        payload = None
        if me == 0:
            teacher_of = {b: name for name, rows in served.items() for b in rows}
            cols: list[list[torch.Tensor]] = [[] for _ in fields]
            for b in held_rows:
                scores, span = pending.results[teacher_of[b]], spans[b]
                i = b if scores.rows is None else int(scores.index([b])[0])  # a view's scores hold its rows
                for col, f, w in zip(cols, fields, widths):
                    col.append(_field(scores, f)[i, span.start : span.stop].reshape(-1, w).to(f.dtype))
            payload = pack_columns([torch.cat(c) for c in cols]).to(device)
        held = [held_rows] + [[] for _ in range(len(layout.places) - 1)]
        counts, starts = [len(sp) for sp in spans], [sp.start for sp in spans]
        received, values = route_rows(payload, held, dests, counts, sum(widths), device)
        columns = unpack_columns(values, widths, [f.dtype for f in fields])
        mine = set(owners.rows())
        out = {}
        for name, rows in served.items():
            kept = [b for b in rows if b in mine]
            dense = {
                f.name: scatter_received(c, received, counts, kept, T, starts).reshape(len(kept), T, *f.trailing(K, 0))
                for f, c in zip(fields, columns)
            }
            out[name] = TokenScores(**dense, rows=kept)
        return out

    def _merge(self, batch: RolloutBatch, mine: list[int], parts: dict[str, TokenScores]) -> TokenScores:
        """One TokenScores of the rows `mine` (increasing) from each teacher's part (each holds its rows)."""
        T = batch.tokens_BS.shape[1] - 1
        out = TokenScores(logprobs_BT=torch.zeros(len(mine), T), rows=list(mine))
        where = {b: i for i, b in enumerate(mine)}
        # Log-probs always (and a cross-tokenizer teacher's spans, beside which every other teacher's token is a
        # span of its own); any other field only when every teacher produced it.
        keep = [
            f
            for f in SCORE_FIELDS
            if f is LOGPROBS
            or (f is SPANS and any(p.spans_BT is not None for p in parts.values()))
            or (parts and all(getattr(p, f.name) is not None for p in parts.values()))
        ]
        for part in parts.values():
            dst = torch.tensor([where[b] for b in part.rows], dtype=torch.long)
            for f in keep:
                value = _field(part, f)
                if getattr(out, f.name) is None:
                    setattr(out, f.name, torch.zeros((len(mine), *value.shape[1:]), dtype=value.dtype))
                getattr(out, f.name)[dst] = value
        if out.spans_BT is not None:  # no span outside the responses (routed rows arrive 0-padded)
            idx = torch.tensor(list(mine), dtype=torch.long)
            start = batch.prompt_lens_B[idx].unsqueeze(1) - 1
            t = torch.arange(T).unsqueeze(0)
            inside = (t >= start) & (t < start + batch.response_lens_B[idx].unsqueeze(1))
            out.spans_BT = torch.where(inside, out.spans_BT, torch.full_like(out.spans_BT, -1))
        return out


def _field(scores: TokenScores, f) -> torch.Tensor:
    """A score field of `scores`; a same-tokenizer teacher's missing spans are one span per token."""
    value = getattr(scores, f.name)
    if value is None and f is SPANS:
        B, T = scores.logprobs_BT.shape
        return torch.arange(T, dtype=torch.int32).expand(B, T).clone()
    return value


def teacher_metric_sums(batch: RolloutBatch, rows_of: dict[str, list[int]]) -> dict[str, float]:
    """Per teacher, the sums and counts behind teacher_metrics over the rows this rank holds (batch.teacher's
    rows): for reduction over the owners before dividing."""
    out = {}
    held = set(batch.teacher.rows if batch.teacher.rows is not None else range(batch.size))
    for name, rows in rows_of.items():
        rows = [b for b in rows if b in held]
        idx = torch.tensor(rows, dtype=torch.long)
        mask = batch.loss_mask_BT[idx].bool()
        local = batch.teacher.index(rows)
        q = batch.teacher.logprobs_BT[local].double()
        out[f"{name}/count"] = float(mask.sum())
        out[f"{name}/teacher_sum"] = float(q[mask].sum())
        if batch.actor is not None:
            out[f"{name}/advantage_sum"] = float(
                (q - batch.actor.logprobs_BT[batch.actor.index(rows)].double())[mask].sum()
            )
    return out


def teacher_metrics_from_sums(
    c: dict[str, float], rows_of: dict[str, list[int]], batch_size: int, prefix: str = "rollout"
) -> dict[str, float]:
    """Per teacher (jobs with several): token-means over its rows' responses of the teacher log-prob and
    the advantage log q - log pi_old, and its share of the batch's samples. Keys
    {prefix}/teacher_logprob_mean/<name>, {prefix}/advantage_mean/<name>, {prefix}/teacher_share/<name>."""
    out = {}
    for name, rows in rows_of.items():
        out[f"{prefix}/teacher_share/{name}"] = len(rows) / max(batch_size, 1)
        if not rows:
            continue
        n = c[f"{name}/count"]
        out[f"{prefix}/teacher_logprob_mean/{name}"] = c[f"{name}/teacher_sum"] / n if n else 0.0
        if f"{name}/advantage_sum" in c:
            out[f"{prefix}/advantage_mean/{name}"] = c[f"{name}/advantage_sum"] / n if n else 0.0
    return out


def teacher_metrics(batch: RolloutBatch, rows_of: dict[str, list[int]], prefix: str = "rollout") -> dict[str, float]:
    """teacher_metrics_from_sums of this rank's rows alone (a rank that holds the whole batch)."""
    return teacher_metrics_from_sums(teacher_metric_sums(batch, rows_of), rows_of, batch.size, prefix)
