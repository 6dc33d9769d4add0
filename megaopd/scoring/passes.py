"""Forward-only scoring passes: per-token outputs of a model for every row of the rollout batch.

    batches = ScoringBatches(micro_batch_size, max_tokens, lengths_B)        # how rows become micro-batches
    scores = score_tokens(runner, tokens_BS, batches, ScoreRequest(temperature, topk=32, entropy=True),
                          owners=owners, layout=layout)                        # TokenScores of the owned rows

What a pass computes at each position t (all vocab-parallel, megaopd.ops; no rank holds full-vocabulary
logits): log p(tokens[t + 1]) at the rollout temperature, optionally the top-k ids and log-probs, the
entropy, and the log-probs at caller-given ids (the teacher at the student's top-k).

Each row's scores end on the ranks of the actor data-parallel replica that trains it (RowOwners), and
only there: the actor and the reference score exactly their owned rows, so their scores never move; a
teacher in another layout scores its own DP share and one all_to_all sends each row's real positions to
its owners (scoring/routing.py). Top-k ids travel and are kept as int32. The tensors of every collective
live on the group's device (megaopd.parallel.dist.device(): the local GPU under NCCL).

Shape legend: B rows, S padded sequence length, T = S - 1 positions, K top-k size, v vocab shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaopd import ops
from megaopd.batching.micro_batches import (
    ScoringBatches,
    ScoringMicroBatch,
    packed_scoring_micro_batches,
    scoring_micro_batches,
)
from megaopd.batching.owners import RowOwners, WorldLayout
from megaopd.batching.packing import PackedRow
from megaopd.losses.needs import LossNeeds, Source
from megaopd.ops.head import LogitsHead, tokenwise
from megaopd.parallel.dist import device as group_device
from megaopd.parallel.dist import global_rank, holds_results
from megaopd.rollout.records import (
    AT_IDS_LOGPROBS,
    ENTROPY,
    LOGPROBS,
    SCORE_FIELDS,
    TOPK_IDS,
    TOPK_LOGPROBS,
    TokenScores,
)
from megaopd.scoring.routing import (
    PassOutputs,
    RowRoutes,
    ScoringAssignment,
    assign_scoring,
    keep_owned,
    route_at_ids,
    scorer_layout,
    send_to_owners,
)
from megaopd.scoring.runner import PipelineRunner


@dataclass(frozen=True)
class ScoreRequest:
    """What a pass computes at every position besides the log-prob of the next token."""

    temperature: float
    """Of the rollout: every log-prob is of softmax(logits / temperature)."""
    topk: int = 0
    """The model's top-k ids and their log-probs (0: none)."""
    entropy: bool = False
    """The entropy of the next-token distribution."""
    at_ids: bool = False
    """The log-probs at ids the caller gives with each pass (the student's top-k: the actor's result). What the
    pass yields follows the ids given (outputs); this says the caller must give them."""

    @classmethod
    def for_loss(cls, needs: LossNeeds, source: Source, temperature: float, overlap_k: int = 0) -> ScoreRequest:
        """What `source`'s pass computes for a step: the scores the loss's declared inputs read of it
        (losses/needs.py), and the overlap metrics' top-k and entropy (overlap_k > 0)."""
        topk, entropy, at_ids = overlap_k, overlap_k > 0, False
        for f, k in needs.inputs():
            if f.source is not source:
                continue
            score = _SCORES.get(f.read)
            if score is None:
                raise ValueError(
                    f"loss input {f.name} reads {f.read!r} of the {source.value}'s pass, which no pass computes; "
                    f"a pass's scores are {', '.join(_SCORES)} (rollout.records.SCORE_FIELDS)"
                )
            if score in (TOPK_IDS, TOPK_LOGPROBS):
                topk = max(topk, k or 0)
            entropy = entropy or score is ENTROPY
            at_ids = at_ids or score is AT_IDS_LOGPROBS
        return cls(temperature, topk, entropy, at_ids)

    def outputs(self, at_ids_BTK: torch.Tensor | None) -> PassOutputs:
        """The score fields the pass yields (log-probs at given ids when it is given some)."""
        wanted = {
            LOGPROBS: True,
            ENTROPY: self.entropy,
            TOPK_IDS: self.topk > 0,
            TOPK_LOGPROBS: self.topk > 0,
            AT_IDS_LOGPROBS: at_ids_BTK is not None,
        }
        return PassOutputs(
            tuple(f for f, want in wanted.items() if want), self.topk, 0 if at_ids_BTK is None else at_ids_BTK.shape[-1]
        )


_SCORES = {f.name: f for f in SCORE_FIELDS}
"""A pass's outputs by TokenScores attribute (a LossInput's `read`). The spans are the alignment's, carried
with a cross-tokenizer teacher's scores, never asked of a pass."""


def score_tokens(
    runner: PipelineRunner,
    tokens_BS: torch.Tensor,
    batches: ScoringBatches,
    request: ScoreRequest,
    at_ids_BTK: torch.Tensor | None = None,
    owners: RowOwners | None = None,
    layout: WorldLayout | None = None,
) -> TokenScores:
    """Log-probs of tokens_BS[:, 1:] (and what `request` adds), each row's landing on the ranks that own it.

    owners: which actor DP replica keeps each row (None: every rank keeps every row, RowOwners.replicated).
    The result holds this rank's owned rows (`rows`, increasing); positions at or past a row's real length
    - 1 (batches.lengths_B) are 0. at_ids_BTK: ids to score at, for this rank's owned rows (owners.rows()
    order). layout: the runner's scorer_layout, gathered once per run (None: gathered by this call).
    Collective over the world (every rank of every layout calls it with the same tokens). CPU tensors."""
    device = group_device()
    owners = owners if owners is not None else RowOwners.replicated(tokens_BS.shape[0], global_rank())
    if len(owners.owner_B) != tokens_BS.shape[0]:
        raise ValueError(
            f"owners cover {len(owners.owner_B)} rows, the batch has {tokens_BS.shape[0]}: pass "
            f"owners.subset(rows) for a sub-batch"
        )
    scorers = layout if layout is not None else scorer_layout(runner.pgs, device)
    routes = RowRoutes(owners=owners, scorers=scorers, owner_layout=owners.world_layout(device))
    assignment = assign_scoring(tokens_BS, batches, runner, routes)
    at_ids = at_ids_BTK
    if at_ids_BTK is not None and not assignment.aligned:
        at_ids = route_at_ids(at_ids_BTK, assignment, routes, device)
    mbs = assigned_micro_batches(tokens_BS, at_ids, assignment, batches, runner)
    outputs = request.outputs(at_ids_BTK)
    local = forward_scores(runner, mbs, request, outputs, len(assignment.rows), assignment.T)
    pgs = runner.pgs
    if assignment.aligned:
        return keep_owned(local, assignment, outputs, owners, pgs.pp, device, ran=bool(mbs))
    speaks = holds_results(pgs)
    return send_to_owners(local, assignment, outputs, routes, speaks, device)


def assigned_micro_batches(
    tokens_BS: torch.Tensor,
    at_ids_BTK: torch.Tensor | None,
    assignment: ScoringAssignment,
    batches: ScoringBatches,
    runner: PipelineRunner,
) -> list[ScoringMicroBatch]:
    """This rank's rows of the pass (assignment.rows) in micro-batches: packed by the token budget (uniform under
    PP, lengths a multiple of the runner's), or batches.micro_batch_size padded rows."""
    rows = assignment.rows
    if assignment.packed:
        return packed_scoring_micro_batches(
            tokens_BS[rows],
            at_ids_BTK,
            [assignment.lengths[i] for i in rows],
            batches.max_tokens,
            uniform=runner.pgs.pp.size() > 1,
            multiple=runner.seq_multiple,
        )
    return scoring_micro_batches(tokens_BS[rows], at_ids_BTK, batches.micro_batch_size)


def forward_scores(
    runner: PipelineRunner,
    mbs: list[ScoringMicroBatch],
    request: ScoreRequest,
    outputs: PassOutputs,
    num_rows: int,
    T: int,
) -> TokenScores | None:
    """The micro-batches through the model: on the last pipeline stage the scores of this rank's rows
    [num_rows, T, ...] in row order; None on the other stages and without micro-batches."""

    def step_fn(mb: ScoringMicroBatch, logits_BSv, _partner):
        return torch.zeros((), device=logits_BSv.device), _scores_of(mb, logits_BSv, request, runner.pgs.tp, T)

    with torch.no_grad():
        results = runner.run(mbs, step_fn, forward_only=True)
    if not results:
        return None
    out = {f.name: torch.cat([getattr(r, f.name) for r in results])[:num_rows] for f in outputs.fields}
    if mbs[0].packed is not None:  # micro-batch order -> this rank's row order
        order = torch.tensor([s.row for mb in mbs for s in mb.packed.segments]).argsort()
        out = {name: x[order] for name, x in out.items()}
    return TokenScores(**out)


def _scores_of(
    mb: ScoringMicroBatch, logits_BSv: torch.Tensor | LogitsHead, request: ScoreRequest, tp_group, T: int
) -> TokenScores:
    """One micro-batch's scores, [b, T, ...] (packed: one row per sequence, zero past each length)."""
    # The ops read the model's logits as they are (bf16 on a GPU) and upcast one 128 MiB chunk of tokens
    # at a time: a .float() here would make a full-vocabulary float32 copy of the micro-batch (2x the
    # logits). They also read all S positions, not logits[:, :-1]: for b > 1 rows that slice is not
    # contiguous and every op would copy it. The last position predicts nothing: its target is a
    # placeholder id 0 and its outputs are dropped ([:, :-1]).
    # logits_BSv may be a LogitsHead (the fused output layer): tokenwise then makes the logits a chunk of
    # tokens at a time and runs every op below on each chunk.
    t = request.temperature
    targets_BS = torch.nn.functional.pad(mb.tokens_BS[:, 1:], (0, 1))
    at_ids = None
    if mb.at_ids_BTK is not None:
        at_ids = torch.nn.functional.pad(mb.at_ids_BTK.long(), (0, 0, 0, 1))  # gathers index with long

    def per_token(z, targets, at):
        entropy = ops.vocab_parallel_entropy(z, tp_group, t) if request.entropy else None
        topk_logprobs, topk_ids = (
            ops.vocab_parallel_topk(z, request.topk, tp_group, t) if request.topk else (None, None)
        )
        at_logprobs = None
        if at is not None:
            lse = ops.vocab_parallel_logsumexp(z, tp_group, t)
            at_logprobs = ops.vocab_parallel_gather(z, at, tp_group) / t - lse.unsqueeze(-1)
        return ops.vocab_parallel_logprobs(z, targets, tp_group, t), entropy, topk_logprobs, topk_ids, at_logprobs

    logprobs, entropy, topk_logprobs, topk_ids, at_logprobs = tokenwise(per_token, logits_BSv, targets_BS, at_ids)
    out = TokenScores(
        logprobs_BT=logprobs,
        entropy_BT=entropy,
        topk_logprobs_BTK=topk_logprobs,
        topk_ids_BTK=topk_ids.int() if topk_ids is not None else None,
        at_ids_logprobs_BTK=at_logprobs,
    )
    out = out.map(lambda x: x[:, :-1])
    if mb.packed is not None:  # back to one row per sequence: [n_seqs, T, ...], zero past each length
        out = out.map(lambda x: _unpack(mb.packed, x, T))
    return out


def _unpack(row: PackedRow, y_1T: torch.Tensor, T: int) -> torch.Tensor:
    """[1, total - 1, ...] of a packed row -> [segments, T, ...], zeros past each segment's length - 1."""
    parts = row.unpack(y_1T)
    out = y_1T.new_zeros((len(parts), T, *y_1T.shape[2:]))
    for i, p in enumerate(parts):
        out[i, : p.shape[0]] = p
    return out


def score_sequences(
    runner: PipelineRunner,
    sequences: list[list[int]],
    micro_batch_size: int = 4,
    pad_id: int = 0,
    temperature: float = 1.0,
    layout: WorldLayout | None = None,
) -> list[list[float]]:
    """log p(x_{i+1} | x_0..x_i) of each sequence (len - 1 values each), right-padded to one length (causal
    attention keeps real positions unaffected). Collective; the lists on every rank."""
    if not sequences:
        return []
    S = max(len(x) for x in sequences)
    tokens_BS = torch.full((len(sequences), S), pad_id, dtype=torch.long)
    for b, x in enumerate(sequences):
        tokens_BS[b, : len(x)] = torch.as_tensor(list(x), dtype=torch.long)
    logprobs_BT = score_tokens(
        runner, tokens_BS, ScoringBatches(micro_batch_size), ScoreRequest(temperature), layout=layout
    ).logprobs_BT
    return [logprobs_BT[b, : len(x) - 1].tolist() for b, x in enumerate(sequences)]
