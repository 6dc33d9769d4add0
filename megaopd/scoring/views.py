"""A teacher's rows in its own view: the sequences it scores (megaopd.data.teacher_view) as a sub-batch, and
its scores mapped back onto the student's rows.

    view = view_rows(batch, rows, prefixes)               # ViewRows: [R, S'] teacher sequences of `rows`
    part = score_tokens(runner, view.tokens_BS, view.batches(batches), request,
                        at_ids_BTK=view.to_view(at_ids, owned), owners=owners.subset(rows))
    part = view.to_student(part, T)                        # [n, T, ...] in the student's positions

Same tokenizer: row r's response tokens sit at view positions v_r .. v_r + n_r - 1 (v_r the teacher's prefix
length) instead of p_r .. p_r + n_r - 1 (p_r the student's prompt length), so the score the teacher gives at
view position v_r - 1 + j is the score of the student's position p_r - 1 + j: a shift per row. Every rank
builds the view of every row (the prefixes come from the data rows, which every rank holds; a row's response
is read from the rank's copy of it): the lengths, and so the scoring shares, are the same on every rank, and a
rank only scores rows it was sent (batching.delivery).

Another vocabulary (TeacherPrompt.cross): the response is re-tokenized for the teacher, so its length in the
teacher's tokens is known only where the row is held; such a teacher scores in the actor's layout (the config
refuses others), each replica its owned rows, which it holds. Its log-probs of its own response tokens are
summed over the aligned spans and spread over the student's tokens of each span
(megaopd.data.alignment.spread_span_logprobs), with the span index of each position in `spans_BT`; the other
fields (top-K ids and entropy of another vocabulary) are dropped.

Shape legend: R rows of the sub-batch, S' the teacher's padded length, T' = S' - 1, T the student's, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megaopd.batching.micro_batches import ScoringBatches
from megaopd.data.alignment import spread_span_logprobs
from megaopd.data.teacher_view import TeacherPrompt, TeacherView, teacher_view
from megaopd.rollout.records import RolloutBatch, TokenScores


@dataclass(frozen=True)
class ViewRows:
    """A teacher's sequences of some batch rows, right-padded as a sub-batch of its own."""

    rows: list[int]
    """The batch rows, in sub-batch order."""
    tokens_BS: torch.Tensor
    """The teacher's sequences [R, S'] (long), right-padded."""
    lengths_B: torch.Tensor
    """Real tokens per sequence [R] (long)."""
    view_starts_B: torch.Tensor
    """Where each response starts in the teacher's sequence [R] (long): its prefix's length."""
    student_starts_B: torch.Tensor
    """Where it starts in the student's row [R] (long): the student's prompt length."""
    response_lens_B: torch.Tensor
    """The student's response tokens [R] (long); the teacher's too under one tokenizer."""
    alignments: list | None = None
    """A cross-tokenizer teacher's SpanAlignment of each row (None for a row not held here); None: one
    tokenizer, the response tokens the same one for one."""

    def batches(self, cut: ScoringBatches) -> ScoringBatches:
        """The scoring cut of the whole batch (micro-batch size, token budget) with the teacher's lengths."""
        return ScoringBatches(cut.micro_batch_size, cut.max_tokens, self.lengths_B)

    def to_student(self, part: TokenScores, T: int) -> TokenScores:
        """The teacher's scores of sub-batch rows (part.rows: sub-batch indices, increasing) moved to the
        student's positions [n, T, ...]; part.rows becomes batch rows. Positions outside the responses: 0.
        Cross-tokenizer: the span log-probs and span ids only (spans -1 outside the responses)."""
        rows = [self.rows[i] for i in part.rows]
        if self.alignments is not None:
            return self._spread(part, T, rows)
        return part.map(lambda x: self._move(x, part.rows, T, to_view=False), rows=rows)

    def to_view(self, at_ids_nTK: torch.Tensor, sub_rows: Sequence[int]) -> torch.Tensor:
        """Ids to score at, given at the student's positions of sub-batch rows `sub_rows` [n, T, K], at the
        teacher's positions [n, T', K]."""
        if self.alignments is not None:
            raise ValueError("ids to score at the student's positions have no counterpart in another vocabulary")
        return self._move(at_ids_nTK, sub_rows, self.tokens_BS.shape[1] - 1, to_view=True)

    def _spread(self, part: TokenScores, T: int, rows: list[int]) -> TokenScores:
        n_rows = len(part.rows)
        logprobs_BT = torch.zeros(n_rows, T)
        spans_BT = torch.full((n_rows, T), -1, dtype=torch.int32)
        for i, r in enumerate(part.rows):
            alignment, n = self.alignments[r], int(self.response_lens_B[r])
            if n == 0 or alignment is None:
                continue
            v, s = int(self.view_starts_B[r]) - 1, int(self.student_starts_B[r]) - 1
            teacher_T = part.logprobs_BT[i, v : v + len(alignment.teacher_span)]
            values, spans = spread_span_logprobs(teacher_T.double(), alignment)  # the sums in float64
            logprobs_BT[i, s : s + n] = values.float()
            spans_BT[i, s : s + n] = spans.int()
        return TokenScores(logprobs_BT=logprobs_BT, spans_BT=spans_BT, rows=rows)

    def _move(self, x: torch.Tensor, sub_rows: Sequence[int], T_out: int, to_view: bool) -> torch.Tensor:
        out = x.new_zeros((x.shape[0], T_out, *x.shape[2:]))
        for i, r in enumerate(sub_rows):
            n = int(self.response_lens_B[r])
            if n == 0:
                continue
            # The response's token j is predicted at position start - 1 + j in either sequence.
            v, s = int(self.view_starts_B[r]) - 1, int(self.student_starts_B[r]) - 1
            src, dst = (s, v) if to_view else (v, s)
            out[i, dst : dst + n] = x[i, src : src + n]
        return out


def row_views(
    batch: RolloutBatch, rows: Sequence[int], prefixes: Sequence[Sequence[int]], prompt: TeacherPrompt | None = None
) -> list[TeacherView]:
    """The TeacherView of each row (prefixes: the teacher's prefix of each, in `rows` order), the response read
    from this rank's copy of the row (padding for a row it was not sent, which it then never scores; under a
    cross-tokenizer teacher such a row gets no response at all, nothing is re-tokenized for it)."""
    out = []
    for b, prefix in zip(rows, prefixes):
        p, n = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
        response = batch.tokens_BS[b, p : p + n].tolist()
        if prompt is not None and prompt.cross:
            held = batch.held_B is None or bool(batch.held_B[b])
            out.append(prompt.view(prefix, response if held else []))
        else:
            out.append(teacher_view(prefix, response))
    return out


def view_rows(
    batch: RolloutBatch,
    rows: Sequence[int],
    prefixes: Sequence[Sequence[int]],
    prompt: TeacherPrompt | None = None,
    pad_id: int = 0,
) -> ViewRows:
    """The teacher's sequences of batch rows `rows` (prefixes: the teacher's prefix of each, in `rows` order;
    prompt: the teacher's TeacherPrompt, which re-tokenizes the responses of a cross-tokenizer teacher)."""
    views = row_views(batch, rows, prefixes, prompt)
    cross = prompt is not None and prompt.cross
    S = max([len(v.ids) for v in views] + [2])
    tokens_BS = torch.full((len(views), S), pad_id, dtype=torch.long)
    for i, v in enumerate(views):
        tokens_BS[i, : len(v.ids)] = torch.tensor(v.ids, dtype=torch.long)
    idx = torch.tensor(list(rows), dtype=torch.long)
    return ViewRows(
        rows=list(rows),
        tokens_BS=tokens_BS,
        lengths_B=torch.tensor([len(v.ids) for v in views], dtype=torch.long),
        view_starts_B=torch.tensor([v.response_start for v in views], dtype=torch.long),
        student_starts_B=batch.prompt_lens_B[idx].long(),
        response_lens_B=batch.response_lens_B[idx].long(),
        alignments=[v.alignment for v in views] if cross else None,
    )


def view_lengths(batch: RolloutBatch, rows: Sequence[int], prefixes: Sequence[Sequence[int]]) -> list[int]:
    """Each row's length in the teacher's view (prefix + response): known on every rank, held rows or not."""
    return [len(p) + int(batch.response_lens_B[b]) for b, p in zip(rows, prefixes)]
