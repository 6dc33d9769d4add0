"""A teacher served by SGLang (or `megaopd serve`): the rollout's responses scored by prefill alone.

    teacher = RemoteTeacher("math", ["http://node3:30000", "http://node4:30000"])
    scores = teacher.score(tokens_BS, prompt_lens_B, response_lens_B, topk=16)   # TokenScores [B, T(, K)]

One /generate request carries `rows_per_request` sequences (prompt + response) as input_ids with
max_new_tokens 0, return_logprob, logprob_start_len = the prompt's length and top_logprobs_num K. SGLang
answers, per sequence, input_token_logprobs (entry j: [log p(token p + j | tokens < p + j), id, text])
and input_top_logprobs (entry j: the K most likely [log-prob, id, text] of that same distribution): they
land at the record's positions t = p - 1 + j, exactly where the in-job teacher's scores of those tokens
are (position t predicts token t + 1; docs/architecture.md). Positions outside the responses (prompt,
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
this call; when no server is left the call raises RemoteTeacherError naming the teacher, the servers and their errors. A 4xx answer is our bug (a bad
request) and fails at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megaopd.rollout.records import TokenScores
from megaopd.rollout.client import EngineRequestError, HttpEngine, HttpEngineConfig
from megaopd.rollout.pool import SpreadError, spread_jobs


class RemoteTeacherError(RuntimeError):
    """A served teacher could not score the batch: every server failed, or a request was refused."""


@dataclass
class RowScores:
    """One row's response scores, entry j about response token j (position prompt_len - 1 + j)."""

    logprobs: list[float]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class RemoteTeacher:
    """Scores responses on SGLang-compatible servers; safe to run in a background thread."""

    def __init__(self, name: str, urls: Sequence[str], rows_per_request: int = 8, timeout_s: float = 600.0,
                 retries: int = 1, backoff_s: float = 0.5):
        if not urls:
            raise ValueError(f"teacher {name!r}: engine remote needs at least one url")
        self.name = name
        self.rows_per_request = rows_per_request
        self.servers = [HttpEngine(HttpEngineConfig(url=u, generate_timeout_s=timeout_s, retries=retries,
                                                    backoff_s=backoff_s)) for u in urls]
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"RemoteTeacher({self.name!r}, {[s.url for s in self.servers]})"

    # ------------------------------------------------------------------------------------------ public
    def score(self, tokens_BS: torch.Tensor, prompt_lens_B: torch.Tensor, response_lens_B: torch.Tensor,
              topk: int = 0, rows: Sequence[int] | None = None) -> TokenScores:
        """TokenScores [B, T(, K)] of the response tokens of `rows` (default: every row); other positions and
        rows are 0. Log-probs at temperature 1 (the config refuses other rollout temperatures)."""
        B, S = tokens_BS.shape
        T = S - 1
        rows = [b for b in (range(B) if rows is None else rows) if int(response_lens_B[b]) > 0]
        per_row = self._score_rows(tokens_BS, prompt_lens_B, response_lens_B, rows, topk)
        logprobs_BT = torch.zeros(B, T)
        ids_BTK = torch.zeros(B, T, topk, dtype=torch.int32) if topk else None
        top_BTK = torch.zeros(B, T, topk) if topk else None
        for b, row in per_row.items():
            p, r = int(prompt_lens_B[b]), int(response_lens_B[b])
            logprobs_BT[b, p - 1:p - 1 + r] = torch.tensor(row.logprobs, dtype=torch.float32)
            if topk:
                ids_BTK[b, p - 1:p - 1 + r] = torch.tensor(row.top_ids, dtype=torch.int32)
                top_BTK[b, p - 1:p - 1 + r] = torch.tensor(row.top_logprobs, dtype=torch.float32)
        return TokenScores(logprobs_BT=logprobs_BT, topk_ids_BTK=ids_BTK, topk_logprobs_BTK=top_BTK)

    # ----------------------------------------------------------------------------------------- private
    def _score_rows(self, tokens_BS, prompt_lens_B, response_lens_B, rows: list[int], topk: int) -> dict[int, RowScores]:
        if not rows:
            return {}
        requests = [rows[i:i + self.rows_per_request] for i in range(0, len(rows), self.rows_per_request)]
        try:
            outs = spread_jobs(self.servers, requests,
                               lambda server, req: self._request(server, tokens_BS, prompt_lens_B, response_lens_B,
                                                                 req, topk),
                               timeout_s=self.timeout_s * (len(requests) + 1),
                               refuse=(EngineRequestError,),  # the server refused what we sent: another one would too
                               label=lambda server: server.url, name=f"megaopd-teacher-{self.name}")
        except SpreadError as e:
            if e.timed_out:
                raise RemoteTeacherError(f"teacher {self.name!r}: scoring did not finish "
                                         f"({e.done}/{e.total} requests done)") from None
            fatal = [f"{f.worker} refused the scoring request: {f.error}" if f.refused else
                     f"every server failed ({len(self.servers)}): " + " | ".join(f.errors) for f in e.failures]
            raise RemoteTeacherError(f"teacher {self.name!r} could not score the step's responses: "
                                     + "; ".join(fatal) + ". Check that the teacher's servers (teacher.urls) run "
                                     "and serve the teacher's model") from None
        return {b: row for out in outs for b, row in out.items()}

    @staticmethod
    def _request(server: HttpEngine, tokens_BS, prompt_lens_B, response_lens_B, rows: list[int],
                 topk: int) -> dict[int, RowScores]:
        seqs, starts = [], []
        for b in rows:
            p, r = int(prompt_lens_B[b]), int(response_lens_B[b])
            seqs.append(tokens_BS[b, :p + r].tolist())
            starts.append(p)
        # Every sampling parameter explicit (servers fill omitted ones from generation_config.json).
        sp = {"max_new_tokens": 0, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "n": 1,
              "stop_token_ids": [], "ignore_eos": False, "skip_special_tokens": False}
        body = {"input_ids": seqs, "sampling_params": [dict(sp) for _ in seqs], "return_logprob": True,
                "logprob_start_len": starts, "stream": False}
        if topk:
            body["top_logprobs_num"] = topk
        out = server.request("POST", "/generate", body, timeout_s=server.config.generate_timeout_s)
        if not isinstance(out, list) or len(out) != len(seqs):
            raise ValueError(f"/generate answered {type(out).__name__} of "
                             f"{len(out) if isinstance(out, list) else 1} entries for {len(seqs)} sequences")
        return {b: _parse(entry, seq, p, topk) for b, entry, seq, p in zip(rows, out, seqs, starts)}


def _parse(entry: dict, seq: list[int], start: int, topk: int) -> RowScores:
    """One answer's input log-probs of tokens start..len-1 (and their distributions' top-K)."""
    try:
        meta = entry["meta_info"]
        lps = meta["input_token_logprobs"]
        tops = meta.get("input_top_logprobs") if topk else None
    except (KeyError, TypeError) as e:
        raise ValueError(f"an answer has no meta_info.input_token_logprobs ({e})") from None
    r = len(seq) - start
    if len(lps) != r:
        raise ValueError(f"input_token_logprobs has {len(lps)} entries for the {r} response tokens "
                         f"(logprob_start_len={start} of {len(seq)})")
    if [int(e[1]) for e in lps] != seq[start:]:
        raise ValueError("input_token_logprobs names other token ids than the sequence sent")
    if any(e[0] is None for e in lps):
        raise ValueError("input_token_logprobs has a null log-prob inside the response")
    row = RowScores(logprobs=[float(e[0]) for e in lps])
    if topk:
        if tops is None or len(tops) != r or any(t is None or len(t) < topk for t in tops):
            raise ValueError(f"input_top_logprobs is missing or has fewer than top_logprobs_num={topk} "
                             f"entries at some of the {r} response positions")
        ranked = [sorted(t, key=lambda e: -float(e[0]))[:topk] for t in tops]  # decreasing probability
        row.top_ids = [[int(e[1]) for e in t] for t in ranked]
        row.top_logprobs = [[float(e[0]) for e in t] for t in ranked]
    return row
