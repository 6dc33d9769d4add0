"""Forward-only scoring passes: per-token outputs of a model for every row of the rollout batch.

    scores = score_tokens(runner, tokens_BS, micro_batch_size, temperature, topk=32, entropy=True)

What a pass computes at each position t (all vocab-parallel, megaopd.ops; no rank holds full-vocabulary
logits): log p(tokens[t + 1]) at the rollout temperature, optionally the top-k ids and log-probs, the
entropy, and the log-probs at caller-given ids (the teacher at the student's top-k).

Each model (actor, teacher) scores the rows of its own data-parallel shard in its own layout; the small
per-token results are then assembled on EVERY rank, so that whichever rank trains a sample in the actor
layout has its scores. Assembly is exact: only the first rank of each model-parallel group
(tp_rank = pp_rank = 0) writes its rows into a zero tensor and the world sums them. The tensors of
every collective live on the group's device (megaopd.parallel.dist.device(): the local GPU under NCCL).

Shape legend: B rows, S padded sequence length, T = S - 1 positions, K top-k size, v vocab shard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from megaopd import ops
from megaopd.parallel.dist import device as group_device
from megaopd.rollout.batch import TokenScores, dp_rows, pad_rows
from megaopd.scoring.packing import PackedRow, Segment, balanced_partition, pack_by_budget, round_up, row_lengths
from megaopd.scoring.runner import PipelineRunner, broadcast_from_last_stage


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
        return ScoringMicroBatch(self.tokens_BS.to(device),
                                 None if self.at_ids_BTK is None else self.at_ids_BTK.to(device), self.packed)


def _micro_batches(tokens_BS: torch.Tensor, at_ids_BTK: torch.Tensor | None, size: int) -> list[ScoringMicroBatch]:
    n = tokens_BS.shape[0]
    if n == 0:
        return []
    rows = -(-n // size) * size
    tokens = pad_rows(tokens_BS, rows).split(size)
    at_ids = pad_rows(at_ids_BTK, rows).split(size) if at_ids_BTK is not None else [None] * len(tokens)
    return [ScoringMicroBatch(t, a) for t, a in zip(tokens, at_ids)]


def _assemble(local: torch.Tensor | None, rows: list[int], full_shape, dtype, contributes: bool,
              device: torch.device) -> torch.Tensor:
    full = torch.zeros(full_shape, dtype=dtype, device=device)
    if contributes and local is not None and len(rows):
        index = torch.tensor(rows, dtype=torch.long, device=device)
        full[index] = local[: len(rows)].to(device=device, dtype=dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(full)
    return full.cpu()


def _packed_micro_batches(tokens_BS: torch.Tensor, at_ids_BTK: torch.Tensor | None, lengths: list[int],
                          max_tokens: int, uniform: bool, multiple: int = 1) -> list[ScoringMicroBatch]:
    """This rank's rows packed into rows of at most max_tokens tokens (uniform: all padded to the
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


def score_tokens(runner: PipelineRunner, tokens_BS: torch.Tensor, micro_batch_size: int, temperature: float,
                 topk: int = 0, entropy: bool = False, at_ids_BTK: torch.Tensor | None = None,
                 lengths_B: torch.Tensor | None = None, max_tokens: int | None = None) -> TokenScores:
    """Log-probs of tokens_BS[:, 1:] (and optional top-k, entropy, log-probs at given ids) for all rows.

    Padded (max_tokens None): contiguous DP rows, micro_batch_size rows per micro-batch. Packed (max_tokens
    given, lengths_B the real tokens per row): DP shares balanced by tokens and attention cost
    (packing.balanced_partition), each rank's rows packed into micro-batches of at most max_tokens tokens;
    positions at or past a row's length - 1 are then 0.

    Collective over the world (every rank of every layout calls it with the same tokens). Returns CPU
    tensors on every rank."""
    pgs: ProcessGroupCollection = runner.pgs
    B, S = tokens_BS.shape
    T = S - 1
    packed = max_tokens is not None and runner.packs
    if packed:
        lengths = row_lengths(tokens_BS, lengths_B)
        rows = balanced_partition([[n] for n in lengths], pgs.dp.size())[pgs.dp.rank()]
        local_at_ids = at_ids_BTK[rows] if at_ids_BTK is not None else None
        mbs = _packed_micro_batches(tokens_BS[rows], local_at_ids, [lengths[i] for i in rows], max_tokens,
                                    uniform=pgs.pp.size() > 1, multiple=runner.seq_multiple)
    else:
        rows = list(dp_rows(B, pgs.dp.rank(), pgs.dp.size()))
        local_at_ids = at_ids_BTK[rows[0]:rows[-1] + 1] if at_ids_BTK is not None and rows else None
        mbs = _micro_batches(tokens_BS[rows[0]:rows[-1] + 1] if rows else tokens_BS[:0], local_at_ids,
                             micro_batch_size)

    def step_fn(mb: ScoringMicroBatch, logits_BSv, _partner):
        logits_BTv = logits_BSv[:, :-1].float()
        targets_BT = mb.tokens_BS[:, 1:]
        out = {"logprobs": ops.vocab_parallel_logprobs(logits_BTv, targets_BT, pgs.tp, temperature)}
        if entropy:
            out["entropy"] = ops.vocab_parallel_entropy(logits_BTv, pgs.tp, temperature)
        if topk:
            out["topk_logprobs"], out["topk_ids"] = ops.vocab_parallel_topk(logits_BTv, topk, pgs.tp, temperature)
        if mb.at_ids_BTK is not None:
            lse = ops.vocab_parallel_logsumexp(logits_BTv, pgs.tp, temperature)
            out["at_ids"] = ops.vocab_parallel_gather(logits_BTv, mb.at_ids_BTK, pgs.tp) / temperature - lse.unsqueeze(-1)
        if mb.packed is not None:  # back to one row per sequence: [n_seqs, T, ...], zero past each length
            out = {k: _unpack(mb.packed, v, T) for k, v in out.items()}
        return torch.zeros((), device=logits_BSv.device), out

    with torch.no_grad():
        results = runner.run(mbs, step_fn, forward_only=True)

    n_local = len(rows) if packed else len(mbs) * micro_batch_size
    first_of_mp = pgs.tp.rank() == 0 and pgs.pp.rank() == 0
    device = group_device()
    order = None
    if packed and mbs:  # micro-batch order -> this rank's row order
        order = torch.tensor([s.row for mb in mbs for s in mb.packed.segments]).argsort()

    def collect(key, trailing=(), dtype=torch.float32):
        local = torch.cat([r[key] for r in results]) if results else None
        if local is not None and order is not None:
            local = local[order]
        if pgs.pp.size() > 1 and mbs:
            local = broadcast_from_last_stage(local, (n_local, T, *trailing), dtype, pgs.pp, device)
        return _assemble(local, rows, (B, T, *trailing), dtype, first_of_mp, device)

    scores = TokenScores(logprobs_BT=collect("logprobs"))
    if entropy:
        scores.entropy_BT = collect("entropy")
    if topk:
        scores.topk_logprobs_BTK = collect("topk_logprobs", (topk,))
        scores.topk_ids_BTK = collect("topk_ids", (topk,), torch.long)
    if at_ids_BTK is not None:
        scores.at_ids_logprobs_BTK = collect("at_ids", (at_ids_BTK.shape[-1],))
    return scores


def _unpack(row: PackedRow, y_1T: torch.Tensor, T: int) -> torch.Tensor:
    """[1, total - 1, ...] of a packed row -> [segments, T, ...], zeros past each segment's length - 1."""
    parts = row.unpack(y_1T)
    out = y_1T.new_zeros((len(parts), T, *y_1T.shape[2:]))
    for i, p in enumerate(parts):
        out[i, :p.shape[0]] = p
    return out


def score_sequences(runner: PipelineRunner, sequences: list[list[int]], micro_batch_size: int = 4,
                    pad_id: int = 0, temperature: float = 1.0) -> list[list[float]]:
    """log p(x_{i+1} | x_0..x_i) of each sequence (len - 1 values each), right-padded to one length (causal
    attention keeps real positions unaffected). Collective; the lists on every rank."""
    if not sequences:
        return []
    S = max(len(x) for x in sequences)
    tokens_BS = torch.full((len(sequences), S), pad_id, dtype=torch.long)
    for b, x in enumerate(sequences):
        tokens_BS[b, :len(x)] = torch.as_tensor(list(x), dtype=torch.long)
    logprobs_BT = score_tokens(runner, tokens_BS, micro_batch_size, temperature).logprobs_BT
    return [logprobs_BT[b, :len(x) - 1].tolist() for b, x in enumerate(sequences)]
