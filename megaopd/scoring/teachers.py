"""The job's teachers, in the job or served, and the routing of every sample to one of them.

    teachers = TeacherSet([InJobTeacher("math", runner, model, offload), RemoteTeacher("code", urls)])
    rows_of = teachers.route([ex.teacher for ex in examples], samples_per_prompt)  # name -> batch rows
    scorers = teachers.scorers(TeacherScoring(request=..., ...))   # one Scorer each (megaopd.scoring.scorers)
    batch.teacher = teachers.merge(whole, {s.name: s.finish(whole) for s in scorers})
    batch.teacher = teachers.score(whole, TeacherScoring(...))    # the same, for a batch that came whole

Each sample is scored by the teacher of its prompt's data source (data.sources[].teacher; with one teacher,
all of them). A teacher kind is a class with a `scorer(settings, prompt)` that makes its Scorer: an in-job
teacher (`InJobTeacher`) a PassScorer (score_tokens, collective over the world, on its rows only), a served
teacher (scoring.remote.RemoteTeacher) a ServedScorer (its rows over HTTP from rank 0, in threads that overlap
the actor's pass, then sent to each row's owners in one all_to_all). The per-teacher results are written into
one TokenScores of this rank's owned rows (RowOwners: the rows its actor replica trains), row by row: the
losses see one record, whoever scored it. A field is kept only when every teacher produced it (entropy: in-job
teachers only).

A teacher with a view of its own (teacher.context / tokenizer: `prompts`) scores its own sequence of each row
(megaopd.scoring.views: its prefix of the row, then the response) and its scores are moved back to the
student's positions before the routing and the merge: nothing downstream knows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import torch

from megaopd.batching.owners import WorldLayout
from megaopd.data.teacher_view import TeacherPrompt
from megaopd.rollout.records import LOGPROBS, SCORE_FIELDS, SPANS, RolloutBatch, TokenScores
from megaopd.scoring.passes import ScoreRequest
from megaopd.scoring.runner import PipelineRunner
from megaopd.scoring.scorers import PassScorer, Scorer, WholeBatch, in_order, score_field


def _no_device(_model, _offload) -> ContextManager:
    return contextlib.nullcontext()


@dataclass(frozen=True, kw_only=True)
class TeacherScoring:
    """What the teachers' scorers of one step compute (the same for every teacher of the job)."""

    request: ScoreRequest
    """What an in-job teacher's pass computes."""
    served_topk: int | None = None
    """The top-K a served teacher gives (None: request.topk)."""
    at_ids: Callable[[], TokenScores | None] | None = None
    """The ids the in-job teachers score at (the student's top-k: the actor scorer's result), or None."""
    on_device: Callable[[torch.nn.Module, bool], ContextManager] = _no_device
    """Brings a model parked in CPU memory onto its device for a pass (trainer.roles.on_gpu_while_used)."""

    @property
    def topk(self) -> int:
        return self.request.topk if self.served_topk is None else self.served_topk


@dataclass
class InJobTeacher:
    """A Megatron teacher inside the job (its stage on this rank and its runner)."""

    name: str
    runner: PipelineRunner
    model: torch.nn.Module
    offload: bool = False
    """Park in CPU memory between uses (GPU only; TeacherScoring.on_device does the moves)."""
    layout: WorldLayout | None = None
    """Its scorer_layout, gathered once at start-up (None: each pass gathers it)."""
    served = False

    def scorer(self, settings: TeacherScoring, prompt: TeacherPrompt | None) -> Scorer:
        return PassScorer(
            name=self.name,
            runner=self.runner,
            request=settings.request,
            layout=self.layout,
            model=self.model,
            offload=self.offload,
            on_device=settings.on_device,
            prompt=prompt,
            at_ids=settings.at_ids,
        )


class TeacherSet:
    """Named teachers and the routing of samples to them (the same object on every rank)."""

    def __init__(self, teachers: Sequence, prompts: dict[str, TeacherPrompt] | None = None):
        """teachers: each of a teacher kind (InJobTeacher, scoring.remote.RemoteTeacher: `name`, `served`,
        `scorer(settings, prompt)`)."""
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

    @property
    def names(self) -> list[str]:
        return list(self.teachers)

    @property
    def has_remote(self) -> bool:
        return any(t.served for t in self.teachers.values())

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
    def scorers(self, settings: TeacherScoring) -> list[Scorer]:
        """One step's Scorer of each teacher, in the teachers' order (each kind makes its own)."""
        return [t.scorer(settings, self.prompts.get(name)) for name, t in self.teachers.items()]

    def score(self, whole: WholeBatch, settings: TeacherScoring) -> TokenScores:
        """The teacher scores of this rank's owned rows of a batch that came whole (whole.owners.rows()), each
        row from its routed teacher: every teacher's Scorer over it. Collective over the world."""
        scorers = in_order(self.scorers(settings))
        for s in scorers:
            s.score_batch(whole)
        return self.merge(whole, {s.name: s.finish(whole) for s in scorers})

    def merge(self, whole: WholeBatch, parts: dict[str, TokenScores]) -> TokenScores:
        """One TokenScores of this rank's owned rows from each teacher's scores (each holds its rows; a teacher
        without rows this step is left out)."""
        batch, mine = whole.batch, whole.owners.rows()
        parts = {name: p for name, p in parts.items() if batch.teacher_rows.get(name)}
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
                value = score_field(part, f)
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
