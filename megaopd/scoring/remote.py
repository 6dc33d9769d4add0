"""A teacher served by SGLang (or `megaopd serve`): the rollout's responses scored by prefill alone.

    teacher = RemoteTeacher("math", ["http://node3:30000", "http://node4:30000"])
    scores = teacher.score(tokens_BS, prompt_lens_B, response_lens_B, topk=16)   # TokenScores [B, T(, K)]

One /generate request carries `rows_per_request` sequences (prompt + response) and asks, by prefill
alone, for the log-probs of each response's tokens and the top-K of their distributions
(HttpEngine.score_prefill: the request and its parsing live in megaopd.rollout.schema, which asks from
logprob_start_len = p - 1 and drops SGLang's null entry at that position). Response token j's scores
land at the record's position t = p - 1 + j, exactly where the in-job teacher's scores of that token are
(position t predicts token t + 1; docs/architecture.md). Positions outside the responses (prompt,
padding) stay 0 (ids 0): every loss and metric reads teacher scores under the loss mask only.

What a served teacher cannot give (the config refuses the first two at start-up, before any model loads):
  - another temperature: SGLang's input log-probs are log softmax(logits) at temperature 1, and a top-K
    cannot be renormalized at another temperature without the rest of the vocabulary;
  - log-probs at the student's top-k ids: SGLang's token_ids_logprob is one id list per request, not one
    per position;
  - entropy: TokenScores.entropy_BT stays None, and the overlap metrics leave out overlap/entropy_gap.

Servers: one thread per server takes requests from a shared queue, so a fast server takes more (the rollout
pool's loop, megaopd.rollout.pool.spread_jobs). A request whose server fails (no answer after its retries, a
5xx, a malformed answer) goes back on the queue for another server, and that server takes no more requests in
this call; when no server is left the call raises RemoteTeacherError naming the teacher, the servers and their
errors. A 4xx answer is our bug (a bad
request) and fails at once. A server that answers nothing (not even GET /health) for stall_timeout_s fails its
request at once (EngineStalledError: megaopd.rollout.waits), and a stop request (the trainer's preemption
flag) gives the whole call up with WaitAbandoned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from megaopd.rollout.client import EngineRequestError, HttpEngine, HttpEngineConfig
from megaopd.rollout.pool import SpreadError, SpreadRules, spread_jobs
from megaopd.rollout.records import TokenScores
from megaopd.rollout.schema import PrefillScores
from megaopd.scoring.scorers import ServedScorer


class RemoteTeacherError(RuntimeError):
    """A served teacher could not score the batch: every server failed, or a request was refused."""


@dataclass(frozen=True, kw_only=True)
class ServerPolicy:
    """How a served teacher asks its servers (the trainer's from TeacherConfig and rollout.stall_timeout_s)."""

    rows_per_request: int = 8
    """Responses per /generate request: the unit spread over the servers and retried."""
    timeout_s: float = 600.0
    """Longest wait for one scoring request."""
    retries: int = 1
    """Extra attempts on the same server after a connection error or 5xx, before the request moves on."""
    backoff_s: float = 0.5
    """First wait before a retry (HttpEngineConfig.backoff_s)."""
    stall_timeout_s: float = 30.0
    """A server's longest silence (HttpEngineConfig.stall_timeout_s)."""
    api_key_env: str = "MEGAOPD_API_KEY"
    """The variable holding the servers' key (teacher.api_key_env); HttpEngine sends it."""


class RemoteTeacher:
    """Scores responses on SGLang-compatible servers; safe to run in a background thread."""

    served = True
    """A teacher kind of scoring.teachers.TeacherSet: its rows are scored on rank 0, over HTTP."""

    def __init__(
        self,
        name: str,
        urls: Sequence[str],
        policy: ServerPolicy = ServerPolicy(),
        stop: Callable[[], bool] | None = None,
    ):
        """stop: every wait is given up once it is true (PreemptionFlag.signalled)."""
        if not urls:
            raise ValueError(f"teacher {name!r}: engine remote needs at least one url")
        self.name = name
        self.rows_per_request = policy.rows_per_request
        self.servers = [
            HttpEngine(
                HttpEngineConfig(
                    url=u,
                    generate_timeout_s=policy.timeout_s,
                    retries=policy.retries,
                    backoff_s=policy.backoff_s,
                    stall_timeout_s=policy.stall_timeout_s,
                    api_key_env=policy.api_key_env,
                    name=f"teacher {name!r} urls[{i}]",
                ),
                stop=stop,
            )
            for i, u in enumerate(urls)
        ]
        self.timeout_s = policy.timeout_s
        self.last_reused = 0
        """Rows the last score() took from `scored` instead of asking (rank 0's scoring thread reads it)."""

    def scorer(self, settings, prompt=None) -> ServedScorer:
        """Its Scorer of one step (settings: scoring.teachers.TeacherScoring; prompt: its view of its own)."""
        return ServedScorer(name=self.name, teacher=self, topk=settings.topk, prompt=prompt)

    def __repr__(self) -> str:
        return f"RemoteTeacher({self.name!r}, {[s.url for s in self.servers]})"

    # ------------------------------------------------------------------------------------------ public
    def score(
        self,
        tokens_BS: torch.Tensor,
        prompt_lens_B: torch.Tensor,
        response_lens_B: torch.Tensor,
        topk: int = 0,
        rows: Sequence[int] | None = None,
        scored: dict[int, tuple[list[int], PrefillScores]] | None = None,
    ) -> TokenScores:
        """TokenScores [B, T(, K)] of the response tokens of `rows` (default: every row); other positions and
        rows are 0. Log-probs at temperature 1 (the config refuses other rollout temperatures). scored: rows
        score_sequences already scored while the batch generated (row -> (its sequence, scores)); a row is
        asked again when its sequence is not the batch's (a sample regenerated since)."""
        B, S = tokens_BS.shape
        T = S - 1
        rows = [b for b in (range(B) if rows is None else rows) if int(response_lens_B[b]) > 0]
        seqs = {b: tokens_BS[b, : int(prompt_lens_B[b]) + int(response_lens_B[b])].tolist() for b in rows}
        per_row = {b: sc for b, (seq, sc) in (scored or {}).items() if b in seqs and seq == seqs[b]}
        self.last_reused = len(per_row)
        todo = [b for b in rows if b not in per_row]
        per_row.update(self._score_rows(todo, [seqs[b] for b in todo], [int(prompt_lens_B[b]) for b in todo], topk))
        logprobs_BT = torch.zeros(B, T)
        ids_BTK = torch.zeros(B, T, topk, dtype=torch.int32) if topk else None
        top_BTK = torch.zeros(B, T, topk) if topk else None
        for b, row in per_row.items():
            p, r = int(prompt_lens_B[b]), int(response_lens_B[b])
            logprobs_BT[b, p - 1 : p - 1 + r] = torch.tensor(row.logprobs, dtype=torch.float32)
            if topk:
                ids_BTK[b, p - 1 : p - 1 + r] = torch.tensor(row.top_ids, dtype=torch.int32)
                top_BTK[b, p - 1 : p - 1 + r] = torch.tensor(row.top_logprobs, dtype=torch.float32)
        return TokenScores(logprobs_BT=logprobs_BT, topk_ids_BTK=ids_BTK, topk_logprobs_BTK=top_BTK)

    def score_sequences(
        self, rows: list[int], seqs: list[list[int]], firsts: list[int], topk: int = 0
    ) -> dict[int, tuple[list[int], PrefillScores]]:
        """Row -> (sequence, scores of its tokens from index first on): what score() takes as `scored`."""
        keep = [i for i, (seq, first) in enumerate(zip(seqs, firsts)) if len(seq) > first]
        out = self._score_rows([rows[i] for i in keep], [seqs[i] for i in keep], [firsts[i] for i in keep], topk)
        return {rows[i]: (seqs[i], out[rows[i]]) for i in keep}

    # ----------------------------------------------------------------------------------------- private
    def _score_rows(
        self, rows: list[int], seqs: list[list[int]], firsts: list[int], topk: int
    ) -> dict[int, PrefillScores]:
        """Row rows[i]'s scores of seqs[i]'s tokens from firsts[i] on, spread over the servers."""
        if not rows:
            return {}
        step = self.rows_per_request
        requests = [(rows[i : i + step], seqs[i : i + step], firsts[i : i + step]) for i in range(0, len(rows), step)]
        try:
            outs = spread_jobs(
                self.servers,
                requests,
                lambda server, req: RemoteTeacher._request(server, *req, topk),
                SpreadRules(
                    timeout_s=self.timeout_s * (len(requests) + 1),
                    refuse=(EngineRequestError,),  # the server refused what we sent: another one would too
                    label=lambda server: server.url,
                    name=f"megaopd-teacher-{self.name}",
                ),
            )
        except SpreadError as e:
            if e.timed_out:
                raise RemoteTeacherError(
                    f"teacher {self.name!r}: scoring did not finish ({e.done}/{e.total} requests done)"
                ) from None
            fatal = [
                f"{f.worker} refused the scoring request: {f.error}"
                if f.refused
                else f"every server failed ({len(self.servers)}): " + " | ".join(f.errors)
                for f in e.failures
            ]
            raise RemoteTeacherError(
                f"teacher {self.name!r} could not score the step's responses: "
                + "; ".join(fatal)
                + ". Check that the teacher's servers (teacher.urls) run "
                "and serve the teacher's model"
            ) from None
        return {b: row for out in outs for b, row in out.items()}

    @staticmethod
    def _request(
        server: HttpEngine, rows: list[int], seqs: list[list[int]], firsts: list[int], topk: int
    ) -> dict[int, PrefillScores]:
        """One request: row rows[i]'s scores of seqs[i]'s tokens from firsts[i] on (entry j: token firsts[i] + j)."""
        return dict(zip(rows, server.score_prefill(seqs, firsts, topk)))
