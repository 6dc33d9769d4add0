"""Micro-batches: a step's rows cut into what one forward pass holds, for the training step and the scoring
passes. Pure functions of the records, the rows, the data-parallel rank and the loss's needs.

    mini = MiniBatch(rollout, loss_mask_BT, golden, rows, golden_rows)   # one optimizer step's rows
    micro = step_micro_batches(mini, dp_rank, dp_size, needs, settings)  # settings: BatchingSettings
    inputs = micro[i].to(device).loss_inputs(logits_BSv, partner_BSv, tp_group, temperature, needs)

Padded (`assemble_micro_batches`): each micro-batch holds up to micro_batch_size on-policy rows (padded to
exactly that many), then its share of the golden rows, then nothing else: every micro-batch of a step has
the same [R, S] shape, as megatron's pipeline buffers require. The loss denominators (StepCounts) are counted
over the WHOLE mini-batch, every DP rank's rows, so that gradient accumulation over micro-batches and the DP
sum give exactly the one-big-batch gradient (losses/inputs.py "Counts").

Packed (trainer.pack_sequences, `assemble_packed_micro_batches`): every micro-batch is ONE row [1, t] of
whole sequences laid end to end (on-policy and golden beside each other), at most max_tokens tokens;
the DP shares are balanced by token count and attention cost (batching/shares.py), a GRPO group stays in
one micro-batch, and the same StepCounts make the same one-big-batch gradient.

Scoring passes (`scoring_micro_batches`, `packed_scoring_micro_batches`) cut the rows a rank scores the
same two ways, into ScoringMicroBatch records.

Shape legend: R rows of a micro-batch, S padded sequence length, T = S - 1 positions, K top-k size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megaopd.batching.fields import holder, needed_fields, value
from megaopd.batching.packing import GOLDEN, ON_POLICY, PackedRow, Segment, pack_by_budget, round_up
from megaopd.batching.padding import pad_rows, pad_to
from megaopd.batching.settings import BatchingSettings, Packing
from megaopd.batching.shares import dp_rows, dp_shares
from megaopd.data import GoldenBatch
from megaopd.losses import LossInput, LossInputs, LossNeeds
from megaopd.rollout.records import RolloutBatch, TokenScores


@dataclass(frozen=True)
class StepCounts:
    """The loss denominators of one optimizer step (whole mini-batch, every DP rank); None = no such rows."""

    global_num_tokens: float | None = None
    """On-policy loss tokens."""
    global_num_seqs: float | None = None
    """On-policy sequences with at least one loss token."""
    global_num_golden_tokens: float | None = None
    """Golden (SFT) loss tokens."""
    global_num_golden_seqs: float | None = None
    """Golden sequences with at least one loss token."""


@dataclass(frozen=True)
class MiniBatch:
    """The rows of one optimizer step, before they are shared over DP and cut into micro-batches."""

    rollout: RolloutBatch | None
    """The step's rollout record (None: SFT alone)."""
    loss_mask_BT: torch.Tensor | None
    """The rollout's loss mask after special-token masking [B, T] (None without a rollout)."""
    golden: GoldenBatch | None
    """The step's golden solutions (None: the loss reads none)."""
    rows: torch.Tensor | None
    """This mini-batch's on-policy rows of `rollout` (long)."""
    golden_rows: torch.Tensor | None
    """This mini-batch's rows of `golden` (long)."""
    loss_tokens_B: torch.Tensor | None = None
    """loss_mask_BT's row sums over the whole batch [B], for the denominators: a rank holds only the rows it
    trains (batching.delivery), the counts are of every row. None: summed here (a rank holding every row)."""


@dataclass
class MicroBatch:
    """One micro-batch: on-policy rows first, then golden rows."""

    tokens_BS: torch.Tensor
    """Input ids [R, S] (long): on-policy rows (padded with pad_id rows), then golden rows."""
    loss_mask_BT: torch.Tensor
    """1 where position t's target counts in the on-policy losses [R, T]; 0 on golden and padding rows."""
    golden_mask_BT: torch.Tensor
    """1 where position t's target counts in the SFT loss [R, T]; 0 on on-policy rows."""
    counts: StepCounts
    inputs: dict[LossInput, torch.Tensor] = dataclasses.field(default_factory=dict)
    """The inputs this loss reads (batching.fields.needed_fields) on this micro-batch's rows: [R, T(, K)] per
    token, [R] per sequence ([num_seqs] packed); their pad value at padding and golden rows."""
    seq_ids_BT: torch.Tensor | None = None
    """Packed rows: the sequence of each position [1, T] (per-sequence inputs are then per sequence)."""
    packed: PackedRow | None = None
    """Packed rows: the row's layout (the runner passes its cu_seqlens to the model); None = padded."""

    def to(self, device: torch.device) -> "MicroBatch":
        """The record with every tensor on `device` (the runner calls this, once per micro-batch)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved, inputs={f: x.to(device) for f, x in self.inputs.items()})

    def loss_inputs(
        self, logits_BSv: torch.Tensor, partner_BSv: torch.Tensor | None, tp_group, temperature: float, needs: LossNeeds
    ) -> LossInputs:
        """The loss's record: logits and targets shifted so that position t predicts token t + 1; the
        lockstep partner's logits are the reference's (ref_kl) or the teacher's (gkd)."""
        logits_BTv = logits_BSv[:, :-1]
        targets_BT = self.tokens_BS[:, 1:]
        partner_BTv = partner_BSv[:, :-1] if partner_BSv is not None else None
        c = self.counts
        return LossInputs(
            logits_BTv=logits_BTv,
            token_ids_BT=targets_BT,
            loss_mask_BT=self.loss_mask_BT,
            tp_group=tp_group,
            seq_ids_BT=self.seq_ids_BT,
            golden_seq_ids_BT=self.seq_ids_BT if needs.golden else None,
            temperature=temperature,
            ref_logits_BTv=partner_BTv if needs.reference else None,
            # The partner's logits die with this micro-batch: the fused backward may take their memory.
            ref_logits_disposable=needs.reference and not needs.teacher_logits,
            teacher_logits_BTv=partner_BTv if needs.teacher_logits else None,
            # Golden rows share the on-policy forward: the SFT term reads the same logits, its own mask.
            golden_logits_BTv=logits_BTv if needs.golden else None,
            golden_ids_BT=targets_BT if needs.golden else None,
            golden_mask_BT=self.golden_mask_BT if needs.golden else None,
            global_num_tokens=c.global_num_tokens,
            global_num_seqs=c.global_num_seqs,
            global_num_golden_tokens=c.global_num_golden_tokens,
            global_num_golden_seqs=c.global_num_golden_seqs,
            **{f.name: f.on_device(x) for f, x in self.inputs.items()},
        )


def step_counts(
    loss_mask_BT: torch.Tensor | None,
    rows: torch.Tensor,
    golden: GoldenBatch | None,
    golden_rows: torch.Tensor | None,
    loss_tokens_B: torch.Tensor | None = None,
) -> StepCounts:
    """The denominators of the mini-batch made of `rows` (on-policy) and `golden_rows` (loss_tokens_B: the
    on-policy rows' loss tokens, MiniBatch.loss_tokens_B)."""
    values = {}
    if loss_mask_BT is not None:
        per_row = (loss_tokens_B if loss_tokens_B is not None else loss_mask_BT.sum(-1))[rows]
        values["global_num_tokens"] = float(per_row.sum())
        values["global_num_seqs"] = float((per_row > 0).sum())
    if golden is not None:
        g_mask_BT = golden.loss_mask_BT[:, 1:]  # position t predicts token t + 1
        values["global_num_golden_tokens"] = float(g_mask_BT[golden_rows].sum())
        values["global_num_golden_seqs"] = float((g_mask_BT[golden_rows].sum(-1) > 0).sum())
    return StepCounts(**values)


def assemble_micro_batches(
    mini: MiniBatch, dp_rank: int, dp_size: int, needs: LossNeeds, micro_batch_size: int, pad_id: int
) -> list[MicroBatch]:
    """This DP rank's share of one mini-batch, cut into equal-shaped micro-batches of padded rows. With no
    rollout (SFT alone) the micro-batches are micro_batch_size golden rows each."""
    rollout, loss_mask_BT, golden, rows, golden_rows = (
        mini.rollout,
        mini.loss_mask_BT,
        mini.golden,
        mini.rows,
        mini.golden_rows,
    )
    counts = step_counts(loss_mask_BT, rows, golden, golden_rows, mini.loss_tokens_B)
    local, S = torch.arange(0), 0
    if rollout is not None:
        units, shares = dp_shares(rollout, None, rows, None, dp_size, needs, packed=False)
        local = torch.tensor([units[i][0].row for i in shares[dp_rank]], dtype=torch.long)
        rollout.check_held(local, "the training micro-batches")
        S = rollout.tokens_BS.shape[1]
    g_local = None
    if golden is not None:
        g_local = golden_rows[list(dp_rows(len(golden_rows), dp_rank, dp_size))]
        S = max(S, golden.input_ids_BT.shape[1])
    mbs = micro_batch_size if rollout is not None else 0
    if rollout is not None:
        n_micro = max(1, -(-len(local) // mbs))
        g_per = 0 if g_local is None else -(-len(g_local) // n_micro)  # golden rows spread evenly
    else:
        g_per = micro_batch_size
        n_micro = max(1, -(-len(g_local) // g_per))
    shape = _PaddedShape(mbs=mbs, g_per=g_per, S=S)
    return [
        _one_micro_batch(
            mini,
            local[i * mbs : (i + 1) * mbs],
            g_local[i * g_per : (i + 1) * g_per] if g_local is not None else torch.arange(0),
            shape,
            needs,
            counts,
            pad_id,
        )
        for i in range(n_micro)
    ]


@dataclass(frozen=True, kw_only=True)
class _PaddedShape:
    """Every padded micro-batch of a mini-batch: mbs on-policy rows, then g_per golden rows, of S tokens."""

    mbs: int
    g_per: int
    S: int

    @property
    def T(self) -> int:
        """Predicted positions: position t predicts token t + 1."""
        return self.S - 1


def _one_micro_batch(
    mini: MiniBatch,
    r: torch.Tensor,
    gr: torch.Tensor,
    shape: _PaddedShape,
    needs: LossNeeds,
    counts: StepCounts,
    pad_id: int,
) -> MicroBatch:
    """The micro-batch of on-policy rows r (padded to shape.mbs) and golden rows gr (padded to shape.g_per)."""
    rollout, loss_mask_BT, golden = mini.rollout, mini.loss_mask_BT, mini.golden
    mbs, g_per, S, T = shape.mbs, shape.g_per, shape.S, shape.T

    def rows_of(x, fill=0):
        """On-policy rows r of x (padded to mbs), then g_per rows of fill: [mbs + g_per, ...]."""
        x = pad_rows(x[r], mbs, fill)
        return torch.cat([x, torch.full((g_per, *x.shape[1:]), fill, dtype=x.dtype)]) if g_per else x

    def per_token(x_BT, fill=0.0):  # [B, T'(, K)] -> this micro-batch's rows, [mbs + g_per, T(, K)]
        return pad_to(rows_of(x_BT, fill), T, fill)

    R = mbs + g_per
    mb = MicroBatch(
        tokens_BS=torch.full((R, S), pad_id, dtype=torch.long),
        loss_mask_BT=torch.zeros(R, T),
        golden_mask_BT=torch.zeros(R, T),
        counts=counts,
    )
    if rollout is not None:
        mb.tokens_BS = pad_to(rows_of(rollout.tokens_BS, pad_id), S, pad_id)
        mb.loss_mask_BT = per_token(loss_mask_BT)
        mb.inputs = {f: _padded_input(f, k, rollout, r, mbs, g_per, T) for f, k in needed_fields(needs, rollout)}
    if g_per:
        mb.tokens_BS[mbs:] = pad_to(pad_rows(golden.input_ids_BT[gr], g_per, pad_id), S, pad_id)
        mb.golden_mask_BT[mbs:] = pad_to(pad_rows(golden.loss_mask_BT[gr][:, 1:], g_per), T)
    return mb


def _padded_input(
    field: LossInput, k: int | None, rollout: RolloutBatch, r: torch.Tensor, mbs: int, g_per: int, T: int
) -> torch.Tensor:
    """A loss input on a padded micro-batch: on-policy rows r (padded to mbs rows), then g_per golden rows;
    the field's pad value on padding and golden rows and past each row's positions."""
    held = holder(field, rollout)
    x = value(field, rollout, k)
    x = x[held.index(r)] if isinstance(held, TokenScores) else x[r]  # scores hold this rank's rows only
    fill = 0 if field.pad is None else field.pad
    x = pad_rows(x, mbs, fill)
    if g_per:
        x = torch.cat([x, torch.full((g_per, *x.shape[1:]), fill, dtype=x.dtype)])
    if field.pad is None:  # padding and golden rows: groups of their own (no loss tokens, no effect on others)
        x = torch.where(torch.arange(mbs + g_per) < len(r), x, rollout.size + torch.arange(mbs + g_per))
    return x if field.per_sequence else pad_to(x, T, fill)


def assemble_packed_micro_batches(
    mini: MiniBatch, dp_rank: int, dp_size: int, needs: LossNeeds, packing: Packing
) -> list[MicroBatch]:
    """This DP rank's share of one mini-batch as packed micro-batches (one [1, t] row each, t <=
    packing.max_tokens unless one unit is longer). The share is balanced over DP by tokens and attention cost;
    packing.uniform pads every micro-batch to the largest t (PP > 1: fixed-size pipeline buffers). Always at
    least one micro-batch (an empty one holds a padding segment) so every rank takes part in the gradient
    reduction."""
    max_tokens, pad_id, uniform, multiple = packing.max_tokens, packing.pad_id, packing.uniform, packing.multiple
    rollout, loss_mask_BT, golden = mini.rollout, mini.loss_mask_BT, mini.golden
    counts = step_counts(loss_mask_BT, mini.rows, golden, mini.golden_rows, mini.loss_tokens_B)
    units, shares = dp_shares(rollout, golden, mini.rows, mini.golden_rows, dp_size, needs, packed=True)
    mine = [units[i] for i in shares[dp_rank]]
    if rollout is not None:
        rollout.check_held([s.row for u in mine for s in u if s.source == ON_POLICY], "the training micro-batches")
    bins = pack_by_budget([sum(s.length for s in u) for u in mine], max_tokens) or [[]]
    layouts = [[s for i in b for s in mine[i]] for b in bins]
    largest = max(max(sum(s.length for s in segs) for segs in layouts), 2)
    # Sequence parallelism splits a row's tokens over TP: every row is padded to a multiple of `multiple`.
    return [
        _packed_micro_batch(
            mini,
            PackedRow(segs, round_up(largest if uniform else max(sum(s.length for s in segs), 2), multiple)),
            needs,
            counts,
            pad_id,
        )
        for segs in layouts
    ]


def _packed_micro_batch(
    mini: MiniBatch, row: PackedRow, needs: LossNeeds, counts: StepCounts, pad_id: int
) -> MicroBatch:
    """The micro-batch of one packed row (its segments: on-policy and golden rows of the mini-batch)."""
    rollout, loss_mask_BT, golden = mini.rollout, mini.loss_mask_BT, mini.golden
    sources = {}
    if rollout is not None:
        sources[ON_POLICY] = rollout.tokens_BS
    if golden is not None:
        sources[GOLDEN] = golden.input_ids_BT
    T = row.total - 1
    mb = MicroBatch(
        tokens_BS=row.tokens(sources, pad_id),
        loss_mask_BT=torch.zeros(1, T),
        golden_mask_BT=torch.zeros(1, T),
        counts=counts,
        seq_ids_BT=row.seq_ids(),
        packed=row,
    )
    if rollout is not None:
        mb.loss_mask_BT = row.per_token(loss_mask_BT, ON_POLICY)
        layouts: dict = {}  # per Source of scores: the row's layout in the rows it holds (built once)
        mb.inputs = {f: _packed_input(f, k, rollout, row, layouts) for f, k in needed_fields(needs, rollout)}
    if golden is not None:
        mb.golden_mask_BT = row.per_token(golden.loss_mask_BT[:, 1:], GOLDEN)
    return mb


def _packed_input(
    field: LossInput, k: int | None, rollout: RolloutBatch, row: PackedRow, layouts: dict
) -> torch.Tensor:
    """A loss input on a packed row: per token [1, T] at each on-policy segment's positions; per sequence
    [num_seqs] (segments, then the padding segment). The field's pad value on golden and padding ones."""
    x = value(field, rollout, k)
    if field.per_sequence:
        n_pad = row.num_seqs - len(row.segments)
        on_S = torch.tensor([s.source == ON_POLICY for s in row.segments] + [False] * n_pad)
        src_S = torch.tensor(
            [s.row if s.source == ON_POLICY else 0 for s in row.segments] + [0] * n_pad, dtype=torch.long
        )
        pad = rollout.size + torch.arange(row.num_seqs) if field.pad is None else torch.tensor(field.pad, dtype=x.dtype)
        return torch.where(on_S, x[src_S], pad)
    held = holder(field, rollout)
    if isinstance(held, TokenScores):  # the scores hold this rank's rows: segments point at their positions
        if field.source not in layouts:
            layouts[field.source] = _held_layout(row, held)
        return layouts[field.source].per_token(x, ON_POLICY, fill=field.pad)
    return row.per_token(x, ON_POLICY, fill=field.pad)


def _held_layout(row: PackedRow, scores) -> PackedRow:
    """`row` with each on-policy segment's row replaced by its position among the rows `scores` holds."""
    on = [s.row for s in row.segments if s.source == ON_POLICY]
    local = dict(zip(on, scores.index(on).tolist())) if on else {}
    return PackedRow(
        [Segment(s.source, local[s.row], s.length) if s.source == ON_POLICY else s for s in row.segments], row.total
    )


def step_micro_batches(
    mini: MiniBatch, dp_rank: int, dp_size: int, needs: LossNeeds, settings: BatchingSettings
) -> list[MicroBatch]:
    """The micro-batches of one mini-batch as the settings ask: packed by their token budget (uniform lengths
    under PP; lengths a multiple of settings.multiple, the TP size under sequence parallelism), or padded rows
    of micro_batch_size (pack_sequences off, or a model that cannot take packed rows: expert parallelism)."""
    if settings.packed:
        return assemble_packed_micro_batches(mini, dp_rank, dp_size, needs, settings.packing)
    return assemble_micro_batches(mini, dp_rank, dp_size, needs, settings.micro_batch_size, settings.pad_id)


# ------------------------------------------------------------------------------------------ scoring passes
@dataclass(frozen=True)
class ScoringBatches:
    """How a scoring pass cuts the rows it scores into micro-batches."""

    micro_batch_size: int
    """Rows per padded micro-batch (trainer.micro_batch_size)."""
    max_tokens: int | None = None
    """Packed micro-batches of at most this many tokens (trainer.max_tokens_per_micro_batch with
    trainer.pack_sequences; used when the model takes packed rows); None: padded rows."""
    lengths_B: torch.Tensor | None = None
    """Real tokens per row [B] (only real positions are scored into the result and move to the owners);
    None: the whole width."""

    def subset(self, batch_rows: torch.Tensor) -> "ScoringBatches":
        """The same cut for a sub-batch made of `batch_rows`."""
        lengths = None if self.lengths_B is None else self.lengths_B[batch_rows]
        return ScoringBatches(self.micro_batch_size, self.max_tokens, lengths)


@dataclass
class ScoringMicroBatch:
    """One micro-batch of a scoring pass."""

    tokens_BS: torch.Tensor
    """Sequences to score [b, S] (long); rows past the batch's end are padding rows."""
    at_ids_BTK: torch.Tensor | None = None
    """Ids to score at each position [b, T, K] (long), or None."""
    packed: PackedRow | None = None
    """The layout of a packed row (b = 1, several sequences); None = one sequence per row."""

    def to(self, device: torch.device) -> "ScoringMicroBatch":
        return ScoringMicroBatch(
            self.tokens_BS.to(device), None if self.at_ids_BTK is None else self.at_ids_BTK.to(device), self.packed
        )


def scoring_micro_batches(
    tokens_BS: torch.Tensor, at_ids_BTK: torch.Tensor | None, size: int
) -> list[ScoringMicroBatch]:
    """A rank's rows to score in micro-batches of `size` rows (the last padded with empty rows)."""
    n = tokens_BS.shape[0]
    if n == 0:
        return []
    rows = -(-n // size) * size
    tokens = pad_rows(tokens_BS, rows).split(size)
    at_ids = pad_rows(at_ids_BTK, rows).split(size) if at_ids_BTK is not None else [None] * len(tokens)
    return [ScoringMicroBatch(t, a) for t, a in zip(tokens, at_ids)]


def packed_scoring_micro_batches(
    tokens_BS: torch.Tensor,
    at_ids_BTK: torch.Tensor | None,
    lengths: list[int],
    max_tokens: int,
    uniform: bool,
    multiple: int = 1,
) -> list[ScoringMicroBatch]:
    """A rank's rows to score packed into rows of at most max_tokens tokens (uniform: all padded to the
    largest, for fixed-size pipeline buffers; every row padded to a multiple of `multiple`)."""
    if not lengths:
        return []
    bins = pack_by_budget(lengths, max_tokens)
    largest = max(sum(lengths[i] for i in b) for b in bins)
    mbs = []
    for b in bins:
        total = round_up(largest if uniform else sum(lengths[i] for i in b), multiple)
        row = PackedRow([Segment(0, i, lengths[i]) for i in b], total)
        at_ids = row.per_token(at_ids_BTK) if at_ids_BTK is not None else None
        mbs.append(ScoringMicroBatch(row.tokens({0: tokens_BS}, 0), at_ids, row))
    return mbs
