"""An in-job scoring pass run part by part while the rest of the batch still generates (rollout.stream_parts
with remote engines, rollout.mode sync), its scores sent to the rows' owners once the whole batch is in.

    stream = StreamedPass(runner, request, layout)
    for part in parts:                                   # as each part returns from the engines
        stream.score(tokens_BS, batch_rows, batches)     # the part's rows (this rank holds its share)
    scores = stream.finish(owners, owner_layout, lengths_B, S)   # TokenScores of the owned rows

The owners of a row are not known while the batch generates (row_owners balances the whole batch over
DP), so each part is shared over the model's DP replicas by its own lengths (`shares`: balanced by tokens
and attention cost when packed, contiguous otherwise), scored, and kept on the share's speaker (TP rank 0 of
the last stage). `finish` then routes every row's real positions to its owners in one all_to_all, as a
teacher in another layout does after a whole-batch pass (routing.send_to_owners): the same values, only the
time they are computed moves. Collective over the world, every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megaopd.batching.micro_batches import ScoringBatches
from megaopd.batching.owners import RowOwners, WorldLayout
from megaopd.batching.packing import row_lengths
from megaopd.parallel.dist import device as group_device
from megaopd.parallel.dist import holds_results
from megaopd.rollout.records import TokenScores
from megaopd.scoring.passes import ScoreRequest, forward_scores, plan_micro_batches
from megaopd.scoring.routing import RowRoutes, ScoringPlan, scoring_shares, send_to_owners
from megaopd.scoring.runner import PipelineRunner


@dataclass
class StreamedPass:
    """One model's pass over a batch's parts, as they come."""

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
        plan = ScoringPlan(shares, pgs.dp.rank(), False, self.packed, lengths, [min(n, S) - 1 for n in lengths], S - 1)
        mbs = plan_micro_batches(tokens_BS, None, plan, batches, self.runner)
        local = forward_scores(self.runner, mbs, self.request, self.request.outputs(None), len(plan.rows), plan.T)
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
        plan = ScoringPlan(self.shares, pgs.dp.rank(), False, self.packed, lengths, [min(n, S) - 1 for n in lengths], T)
        local = None
        if self.local:  # parts padded to the batch's T, in the order their rows were scored (plan.rows)
            local = TokenScores(
                **{f.name: torch.cat([_pad_T(getattr(p, f.name), T) for p in self.local]) for f in outputs.fields}
            )
        speaks = holds_results(pgs)
        routes = RowRoutes(owners=owners, scorers=self.layout, owner_layout=owner_layout)
        return send_to_owners(local, plan, outputs, routes, speaks, device)


def _pad_T(x: torch.Tensor, T: int) -> torch.Tensor:
    """[rows, t, ...] -> [rows, T, ...], zeros after t."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, T - x.shape[1]))
