"""A step's rollout from rank 0, which drives the engines, to the ranks that use its rows: as tensors, each
row only where it is trained or scored.

    batch = broadcast_header(lambda: build_rollout_batch(samples, pad_id, n), pad_id, n, device)  # rank 0 builds
    owners = RowOwners(row_owners(batch, ...), ...)                             # from the lengths alone
    users_B = row_users(owners, owner_layout, [(shares, teacher_layout), ...])  # who reads each row's tokens
    received = deliver_rows(batch, users_B, device)                             # one all_to_all from rank 0

The header is what every rank needs of every row, [B] integers (one broadcast): lengths, the student's
token count, finish reasons, a trajectory's counts. The DP partition (row_owners), the global token
counts and the whole-batch metrics are functions of it. The per-token fields (token ids, the loss mask,
the engine's log-probs) travel once, from rank 0 to each rank of the actor replica that trains the row and
of any in-job teacher replica that scores it in another layout: one all_to_all of the rows' real tokens
(parallel/exchange.py), three float32 columns with the ids bit for bit. At DP replicas, a rank receives
about 1/DP of the batch; before, rank 0 pickled every sample to every rank.

A receiver's record keeps the batch's [B, S] shape (rows are addressed by their batch index everywhere:
micro-batches, scores, metrics) with the rows it does not use left as padding; `held_B` names the rows
it holds, and `RolloutBatch.check_held` refuses a read of any other. Rank 0 holds every row.
"""

from __future__ import annotations

from typing import Callable, Collection, Sequence

import torch
import torch.distributed as dist

from megaopd.batching.owners import RowOwners, WorldLayout
from megaopd.parallel.dist import global_rank, world_size
from megaopd.parallel.exchange import pack_columns, route_rows, scatter_received, unpack_columns
from megaopd.rollout.protocol import TrajectoryStats
from megaopd.rollout.records import RolloutBatch

FINISH = ("stop", "length", "abort")
TRUNCATED_BY = ("", "turns", "tokens")
# Header columns, one row per sample (int64).
_PROMPT, _RESPONSE, _STUDENT, _FINISH, _TRAJECTORY, _TURNS, _CALLS, _ERRORS, _TRUNCATED = range(9)


def broadcast_header(
    make: Callable[[], RolloutBatch], pad_id: int, samples_per_prompt: int, device: torch.device
) -> RolloutBatch:
    """Collective over the world: rank 0 builds its record with make() (it holds every row); every other rank
    gets a record with the same per-row facts and its per-token fields empty (padding; held_B all False)
    until deliver_rows fills the rows it uses. A failure on rank 0 (bad samples) is raised there and, as
    an error naming it, on every other rank, instead of leaving them waiting. `device`: the default group's."""
    if world_size() == 1:
        return make()
    batch, error = None, None
    if global_rank() == 0:
        try:
            batch = make()
            header = _header(batch).to(device)
        except Exception as e:  # noqa: BLE001 - raised below, after the others know
            error = e
        B, S = (-1, 0) if error is not None else (header.shape[0], batch.tokens_BS.shape[1])
        size = torch.tensor([B, S], dtype=torch.long, device=device)
    else:
        size = torch.zeros(2, dtype=torch.long, device=device)
    dist.broadcast(size, src=0)
    B, S = (int(x) for x in size.tolist())
    if error is not None:
        raise error
    if B < 0:
        raise RuntimeError(
            "rank 0 could not build the step's rollout record from the engines' samples: its error is in rank 0's log"
        )
    if global_rank() != 0:
        header = torch.zeros(B, 9, dtype=torch.long, device=device)
    dist.broadcast(header, src=0)
    return batch if global_rank() == 0 else _record(header.cpu(), S, pad_id, samples_per_prompt)


def _record(h: torch.Tensor, S: int, pad_id: int, samples_per_prompt: int) -> RolloutBatch:
    """A receiver's record (CPU, as rank 0's): the header's facts, the per-token fields padding, no row held."""
    B = h.shape[0]
    trajectories = (
        [TrajectoryStats(int(r[_TURNS]), int(r[_CALLS]), int(r[_ERRORS]), TRUNCATED_BY[int(r[_TRUNCATED])]) for r in h]
        if bool(h[:, _TRAJECTORY].any())
        else None
    )
    return RolloutBatch(
        tokens_BS=torch.full((B, S), pad_id, dtype=torch.long),
        loss_mask_BT=torch.zeros(B, S - 1),
        engine_logprobs_BT=torch.zeros(B, S - 1),
        prompt_lens_B=h[:, _PROMPT].clone(),
        response_lens_B=h[:, _RESPONSE].clone(),
        finish_reasons=[FINISH[int(c)] for c in h[:, _FINISH]],
        group_ids_B=torch.arange(B) // samples_per_prompt,
        trajectories=trajectories,
        student_lens_B=h[:, _STUDENT].clone(),
        held_B=torch.zeros(B, dtype=torch.bool),
    )


def _header(batch: RolloutBatch) -> torch.Tensor:
    """[B, 9] int64: the per-row facts every rank needs (the columns above)."""
    h = torch.zeros(batch.size, 9, dtype=torch.long)
    h[:, _PROMPT], h[:, _RESPONSE], h[:, _STUDENT] = batch.prompt_lens_B, batch.response_lens_B, batch.student_lens_B
    h[:, _FINISH] = torch.tensor([FINISH.index(r) for r in batch.finish_reasons])
    if batch.trajectories is not None:
        h[:, _TRAJECTORY] = 1
        h[:, _TURNS : _TRUNCATED + 1] = torch.tensor(
            [[t.turns, t.tool_calls, t.tool_errors, TRUNCATED_BY.index(t.truncated_by)] for t in batch.trajectories],
            dtype=torch.long,
        ).reshape(-1, 4)
    return h


def row_users(
    owners: RowOwners, owner_layout: WorldLayout, scorers: Sequence[tuple[Sequence[Sequence[int]], WorldLayout]] = ()
) -> list[frozenset[int]]:
    """Per batch row, the global ranks that read its tokens: every rank of the actor replica that trains it
    (the actor's and the reference's passes, the loss), and of each scoring pass in another layout
    (`scorers`: per pass, the batch rows each of its DP replicas scores and that model's WorldLayout), the
    ranks of the replica that scores it. Pure: every rank computes the same sets."""
    return [
        frozenset(owner_layout.replica(o)) | s
        for o, s in zip(owners.owner_B, scorer_users(len(owners.owner_B), scorers))
    ]


def scorer_users(num_rows: int, scorers: Sequence[tuple[Sequence[Sequence[int]], WorldLayout]]) -> list[frozenset[int]]:
    """Per row, the global ranks of the scoring passes' replicas that score it (row_users' `scorers`)."""
    users: list[set[int]] = [set() for _ in range(num_rows)]
    for shares, layout in scorers:
        for d, rows in enumerate(shares):
            ranks = layout.replica(d)
            for b in rows:
                users[b] |= ranks
    return [frozenset(u) for u in users]


def deliver_rows(batch: RolloutBatch, users_B: Sequence[Collection[int]], device: torch.device) -> int:
    """Collective over the world: rank 0 sends each row's real tokens (ids, loss mask, engine log-probs) to the
    ranks in users_B[b] (rank 0 keeps its own); each receiver writes them into its record and marks them
    held. Returns the bytes this rank received."""
    if world_size() == 1:
        return 0
    lengths = (batch.prompt_lens_B + batch.response_lens_B).tolist()
    positions = [int(n) for n in lengths]  # a row's tokens; its mask and log-probs are per position (one fewer)
    held = [list(range(batch.size))] + [[] for _ in range(world_size() - 1)]
    dests = [set(u) - {0} for u in users_B]
    payload = None
    if global_rank() == 0:
        T = batch.tokens_BS.shape[1] - 1
        mask = torch.nn.functional.pad(batch.loss_mask_BT, (0, 1))  # position S - 1 predicts nothing
        logprobs = torch.nn.functional.pad(batch.engine_logprobs_BT, (0, 1))
        valid = torch.arange(T + 1).unsqueeze(0) < torch.tensor(positions).unsqueeze(1)
        payload = pack_columns(
            [
                batch.tokens_BS[valid].int().reshape(-1, 1).to(device),
                mask[valid].reshape(-1, 1).to(device),
                logprobs[valid].reshape(-1, 1).to(device),
            ]
        )
    received, values = route_rows(payload, held, dests, positions, 3, device)
    if global_rank() == 0:
        return 0
    ids, mask, logprobs = unpack_columns(values, [1, 1, 1], [torch.int32, torch.float32, torch.float32])
    S = batch.tokens_BS.shape[1]
    rows = sorted(set(received))
    if rows:
        idx = torch.tensor(rows, dtype=torch.long)
        tokens = scatter_received(ids.reshape(-1), received, positions, rows, S).long()
        filled = torch.arange(S).unsqueeze(0) < torch.tensor([positions[b] for b in rows]).unsqueeze(1)
        batch.tokens_BS[idx] = torch.where(filled, tokens, batch.tokens_BS[idx])
        batch.loss_mask_BT[idx] = scatter_received(mask.reshape(-1), received, positions, rows, S)[:, :-1]
        batch.engine_logprobs_BT[idx] = scatter_received(logprobs.reshape(-1), received, positions, rows, S)[:, :-1]
        batch.held_B[idx] = True
    return values.numel() * values.element_size()
