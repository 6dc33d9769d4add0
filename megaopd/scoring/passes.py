"""Forward-only scoring passes: per-token outputs of a model for every row of the rollout batch.

    scores = score_tokens(runner, tokens_BS, micro_batch_size, temperature, topk=32, entropy=True)

What a pass computes at each position t (all vocab-parallel, megaopd.ops; no rank holds full-vocabulary
logits): log p(tokens[t + 1]) at the rollout temperature, optionally the top-k ids and log-probs, the
entropy, and the log-probs at caller-given ids (the teacher at the student's top-k).

Each row's scores end on the ranks of the actor data-parallel replica that trains it (RowOwners), and
only there: the actor and the reference score exactly their owned rows, so their scores never move; a
teacher in another layout scores its own DP share and one all_to_all (scoring/exchange.py) sends each
row's real positions to its owners. Top-k ids travel and are kept as int32. The tensors of every
collective live on the group's device (megaopd.parallel.dist.device(): the local GPU under NCCL).

Shape legend: B rows, S padded sequence length, T = S - 1 positions, K top-k size, v vocab shard.
"""
from __future__ import annotations

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megaopd import ops
from megaopd.batching.micro_batches import ScoringMicroBatch, packed_scoring_micro_batches, scoring_micro_batches
from megaopd.batching.owners import RowOwners, WorldLayout
from megaopd.batching.packing import PackedRow, row_lengths
from megaopd.batching.shares import balanced_partition, dp_rows
from megaopd.parallel.dist import device as group_device, global_rank
from megaopd.rollout.records import TokenScores
from megaopd.scoring.exchange import pack_columns, route_rows, scatter_received, unpack_columns
from megaopd.scoring.runner import PipelineRunner, broadcast_from_last_stage


def score_tokens(runner: PipelineRunner, tokens_BS: torch.Tensor, micro_batch_size: int, temperature: float,
                 topk: int = 0, entropy: bool = False, at_ids_BTK: torch.Tensor | None = None,
                 lengths_B: torch.Tensor | None = None, max_tokens: int | None = None,
                 owners: RowOwners | None = None, layout: WorldLayout | None = None) -> TokenScores:
    """Log-probs of tokens_BS[:, 1:] (and optional top-k, entropy, log-probs at given ids), each row's
    landing on the ranks that own it.

    owners: which actor DP replica keeps each row (None: every rank keeps every row, RowOwners.replicated).
    The result holds this rank's owned rows (`rows`, increasing). When the runner's DP ranks are the owners'
    (the actor, the reference, a teacher in the actor's layout) each DP rank scores exactly its owned rows
    and nothing moves. Otherwise (a teacher in another layout) each DP rank scores its share: padded
    (max_tokens None) contiguous rows, micro_batch_size per micro-batch; packed (max_tokens given) shares
    balanced by tokens and attention cost (packing.balanced_partition), packed by the token budget. Then one
    all_to_all sends each row's real positions (lengths_B[b] - 1) from the share's last PP stage, TP rank 0,
    to every rank of the owning replica (exchange.route_rows; at_ids_BTK travels the other way first).

    at_ids_BTK: ids to score at, for this rank's owned rows (owners.rows() order). lengths_B: real tokens
    per row (None: the whole width); positions at or past a row's length - 1 are 0. layout: the runner's
    scorer_layout, gathered once per run (None: gathered by this call). Collective over the world (every
    rank of every layout calls it with the same tokens). Returns CPU tensors."""
    pgs: ProcessGroupCollection = runner.pgs
    B, S = tokens_BS.shape
    T = S - 1
    packed = max_tokens is not None and runner.packs
    lengths = row_lengths(tokens_BS, lengths_B)
    positions = [min(n, S) - 1 for n in lengths]
    device = group_device()
    me = global_rank()
    owners = owners if owners is not None else RowOwners.replicated(B, me)
    if len(owners.owner_B) != B:
        raise ValueError(f"owners cover {len(owners.owner_B)} rows, the batch has {B}: pass owners.subset(rows) "
                         f"for a sub-batch")
    scorers = layout if layout is not None else scorer_layout(pgs, device)
    owner_layout = owners.world_layout(device)
    last_stage = pgs.pp.rank() == pgs.pp.size() - 1
    aligned = pgs.dp.size() == owners.dp_size and all(
        s.dp_rank == o.dp_rank for s, o in zip(scorers.places, owner_layout.places))
    if aligned:  # the runner's DP replicas are the owners: score the owned rows, keep them
        shares = [owners.rows(d) for d in range(owners.dp_size)]
    elif packed:
        shares = balanced_partition([[n] for n in lengths], pgs.dp.size())
    else:
        shares = [list(dp_rows(B, d, pgs.dp.size())) for d in range(pgs.dp.size())]
    rows = shares[pgs.dp.rank()]
    local_at_ids = None
    if at_ids_BTK is not None:
        local_at_ids = at_ids_BTK if aligned else _route_at_ids(at_ids_BTK, owners, shares, pgs.dp.rank(), scorers,
                                                                owner_layout, positions, T, device)
    if packed:
        mbs = packed_scoring_micro_batches(tokens_BS[rows], local_at_ids, [lengths[i] for i in rows], max_tokens,
                                    uniform=pgs.pp.size() > 1, multiple=runner.seq_multiple)
    else:
        mbs = scoring_micro_batches(tokens_BS[rows], local_at_ids, micro_batch_size)

    def step_fn(mb: ScoringMicroBatch, logits_BSv, _partner):
        # The ops read the model's logits as they are (bf16 on a GPU) and upcast one 128 MiB chunk of tokens
        # at a time: a .float() here would make a full-vocabulary float32 copy of the micro-batch (2x the
        # logits). They also read all S positions, not logits[:, :-1]: for b > 1 rows that slice is not
        # contiguous and every op would copy it. The last position predicts nothing: its target is a
        # placeholder id 0 and its outputs are dropped ([:, :-1]).
        targets_BS = torch.nn.functional.pad(mb.tokens_BS[:, 1:], (0, 1))
        out = {"logprobs": ops.vocab_parallel_logprobs(logits_BSv, targets_BS, pgs.tp, temperature)}
        if entropy:
            out["entropy"] = ops.vocab_parallel_entropy(logits_BSv, pgs.tp, temperature)
        if topk:
            lp, ids = ops.vocab_parallel_topk(logits_BSv, topk, pgs.tp, temperature)
            out["topk_logprobs"], out["topk_ids"] = lp, ids.int()
        if mb.at_ids_BTK is not None:
            lse = ops.vocab_parallel_logsumexp(logits_BSv, pgs.tp, temperature)
            at_ids = torch.nn.functional.pad(mb.at_ids_BTK.long(), (0, 0, 0, 1))  # gathers index with long
            out["at_ids"] = ops.vocab_parallel_gather(logits_BSv, at_ids, pgs.tp) / temperature - lse.unsqueeze(-1)
        out = {k: v[:, :-1] for k, v in out.items()}
        if mb.packed is not None:  # back to one row per sequence: [n_seqs, T, ...], zero past each length
            out = {k: _unpack(mb.packed, v, T) for k, v in out.items()}
        return torch.zeros((), device=logits_BSv.device), out

    with torch.no_grad():
        results = runner.run(mbs, step_fn, forward_only=True)

    fields = [("logprobs", "logprobs_BT", (), torch.float32)]
    if entropy:
        fields.append(("entropy", "entropy_BT", (), torch.float32))
    if topk:
        fields += [("topk_logprobs", "topk_logprobs_BTK", (topk,), torch.float32),
                   ("topk_ids", "topk_ids_BTK", (topk,), torch.int32)]
    if at_ids_BTK is not None:
        fields.append(("at_ids", "at_ids_logprobs_BTK", (at_ids_BTK.shape[-1],), torch.float32))
    order = None
    if packed and mbs:  # micro-batch order -> this rank's row order
        order = torch.tensor([s.row for mb in mbs for s in mb.packed.segments]).argsort()

    def local(key):
        """This rank's scored rows [len(rows), T, ...] in `rows` order (None off the last stage)."""
        if not results:
            return None
        x = torch.cat([r[key] for r in results])[: len(rows)]
        return x[order] if order is not None else x

    valid_BT = _valid_positions([positions[b] for b in rows], T)
    if aligned:  # every TP rank has the results; PP: the last stage's, broadcast over the PP group
        out = {}
        for key, name, trailing, dtype in fields:
            x = local(key)
            if pgs.pp.size() > 1 and mbs:
                x = broadcast_from_last_stage(x, (len(rows), T, *trailing), dtype, pgs.pp, device)
            x = x.cpu() if x is not None else torch.zeros((0, T, *trailing), dtype=dtype)
            out[name] = x * valid_BT.reshape(*valid_BT.shape, *[1] * len(trailing)).to(dtype)
        return TokenScores(**out, rows=owners.rows())

    # Another layout: one all_to_all from each share's speaker to the owning replicas' ranks.
    speaks = pgs.tp.rank() == 0 and last_stage
    held = [shares[p.dp_rank] if p.speaks else [] for p in scorers.places]
    replica = [owner_layout.replica(d) for d in range(owners.dp_size)]
    dests = [replica[o] for o in owners.owner_B]
    widths = [max(1, int(torch.Size(t).numel())) for _k, _n, t, _d in fields]
    payload = None
    if speaks and rows:
        valid = valid_BT.to(device)
        payload = pack_columns([local(k).to(device)[valid].reshape(-1, w) for (k, _n, _t, _d), w in zip(fields, widths)])
    received, values = route_rows(payload, held, dests, positions, sum(widths), device)
    mine = owners.rows()
    out = {name: scatter_received(col.reshape(-1, *trailing), received, positions, mine, T)
           for (_k, name, trailing, _d), col in zip(fields, unpack_columns(values, widths, [f[3] for f in fields]))}
    return TokenScores(**out, rows=mine)


def scorer_layout(pgs: ProcessGroupCollection, device: torch.device) -> WorldLayout:
    """Every global rank's DP replica in a scoring model's layout and whether it speaks for its share (TP rank 0
    of the last PP stage, which holds the results). Fixed for a run: gathered once per model (collective)."""
    return WorldLayout.gather(pgs.dp.rank(), pgs.tp.rank() == 0 and pgs.pp.rank() == pgs.pp.size() - 1, device)


def _route_at_ids(at_ids_BTK: torch.Tensor, owners: RowOwners, shares: list[list[int]], dp_rank: int,
                  scorers: WorldLayout, owner_layout: WorldLayout, positions, T: int,
                  device: torch.device) -> torch.Tensor:
    """The owners' ids to score at -> every rank of the DP replica (runner layout) that scores each row,
    [len(my share), T, K] int32 in share order."""
    K = at_ids_BTK.shape[-1]
    mine = owners.rows()
    scorer = {b: d for d, share in enumerate(shares) for b in share}
    groups = [scorers.replica(d) for d in range(len(shares))]
    dests = [groups[scorer[b]] for b in range(len(positions))]
    held = [owners.rows(p.dp_rank) if p.speaks else [] for p in owner_layout.places]
    payload = None
    if owners.sends and mine:
        valid = _valid_positions([positions[b] for b in mine], T)
        payload = pack_columns([at_ids_BTK[:, :T].int().to(device)[valid.to(device)]])
    received, values = route_rows(payload, held, dests, positions, K, device)
    return scatter_received(unpack_columns(values, [K], [torch.int32])[0], received, positions, shares[dp_rank], T)


def _valid_positions(counts: list[int], T: int) -> torch.Tensor:
    """[len(counts), T] bool: True at the first counts[i] positions of row i."""
    return torch.arange(T).unsqueeze(0) < torch.tensor(counts, dtype=torch.long).reshape(-1, 1)


def _unpack(row: PackedRow, y_1T: torch.Tensor, T: int) -> torch.Tensor:
    """[1, total - 1, ...] of a packed row -> [segments, T, ...], zeros past each segment's length - 1."""
    parts = row.unpack(y_1T)
    out = y_1T.new_zeros((len(parts), T, *y_1T.shape[2:]))
    for i, p in enumerate(parts):
        out[i, :p.shape[0]] = p
    return out


def score_sequences(runner: PipelineRunner, sequences: list[list[int]], micro_batch_size: int = 4,
                    pad_id: int = 0, temperature: float = 1.0, layout: WorldLayout | None = None) -> list[list[float]]:
    """log p(x_{i+1} | x_0..x_i) of each sequence (len - 1 values each), right-padded to one length (causal
    attention keeps real positions unaffected). Collective; the lists on every rank."""
    if not sequences:
        return []
    S = max(len(x) for x in sequences)
    tokens_BS = torch.full((len(sequences), S), pad_id, dtype=torch.long)
    for b, x in enumerate(sequences):
        tokens_BS[b, :len(x)] = torch.as_tensor(list(x), dtype=torch.long)
    logprobs_BT = score_tokens(runner, tokens_BS, micro_batch_size, temperature, layout=layout).logprobs_BT
    return [logprobs_BT[b, :len(x) - 1].tolist() for b, x in enumerate(sequences)]
