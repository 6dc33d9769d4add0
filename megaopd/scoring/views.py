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

Shape legend: R rows of the sub-batch, S' the teacher's padded length, T' = S' - 1, T the student's, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megaopd.batching.micro_batches import ScoringBatches
from megaopd.data.teacher_view import TeacherView, teacher_view
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
    """Response tokens [R] (long), the same in both views under one tokenizer."""

    def batches(self, cut: ScoringBatches) -> ScoringBatches:
        """The scoring cut of the whole batch (micro-batch size, token budget) with the teacher's lengths."""
        return ScoringBatches(cut.micro_batch_size, cut.max_tokens, self.lengths_B)

    def to_student(self, part: TokenScores, T: int) -> TokenScores:
        """The teacher's scores of sub-batch rows (part.rows: sub-batch indices, increasing) moved to the
        student's positions [n, T, ...]; part.rows becomes batch rows. Positions outside the responses: 0."""
        return part.map(lambda x: self._move(x, part.rows, T, to_view=False), rows=[self.rows[i] for i in part.rows])

    def to_view(self, at_ids_nTK: torch.Tensor, sub_rows: Sequence[int]) -> torch.Tensor:
        """Ids to score at, given at the student's positions of sub-batch rows `sub_rows` [n, T, K], at the
        teacher's positions [n, T', K]."""
        return self._move(at_ids_nTK, sub_rows, self.tokens_BS.shape[1] - 1, to_view=True)

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


def row_views(batch: RolloutBatch, rows: Sequence[int], prefixes: Sequence[Sequence[int]]) -> list[TeacherView]:
    """The TeacherView of each row (prefixes: the teacher's prefix of each, in `rows` order), the response read
    from this rank's copy of the row (padding for a row it was not sent, which it then never scores)."""
    out = []
    for b, prefix in zip(rows, prefixes):
        p, n = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
        out.append(teacher_view(prefix, batch.tokens_BS[b, p : p + n].tolist()))
    return out


def view_rows(batch: RolloutBatch, rows: Sequence[int], prefixes: Sequence[Sequence[int]], pad_id: int = 0) -> ViewRows:
    """The teacher's sequences of batch rows `rows` (prefixes: the teacher's prefix of each, in `rows` order)."""
    views = row_views(batch, rows, prefixes)
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
    )


def view_lengths(batch: RolloutBatch, rows: Sequence[int], prefixes: Sequence[Sequence[int]]) -> list[int]:
    """Each row's length in the teacher's view (prefix + response): known on every rank, held rows or not."""
    return [len(p) + int(batch.response_lens_B[b]) for b, p in zip(rows, prefixes)]
