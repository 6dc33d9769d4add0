"""Spawned workers of the delivery test (module level, importable by spawned processes)."""

from __future__ import annotations

import random

PAD = 7
N = 2  # samples per prompt
# Actor DP=2 at TP=2 over 4 ranks (replica r // 2, TP rank 0 speaks); the owner of each of 8 rows.
OWNER = (0, 1, 1, 0, 0, 1, 1, 0)
# A teacher in another layout (DP=4, TP=1) scoring rows 2..6 (its replica d scores SHARES[d]).
SHARES = ([2], [3, 4], [5, 6], [])


def full_batch():
    """The same 8-row batch on every rank: varied lengths, an aborted row, trajectories with environment
    tokens (output_mask 0), each finish reason."""
    from megaopd.rollout.protocol import Sample, TrajectoryStats
    from megaopd.rollout.records import build_rollout_batch

    rng = random.Random(0)
    samples = []
    for b in range(8):
        p, r = rng.randint(2, 6), (0 if b == 3 else rng.randint(1, 9))
        mask = [1] * r if b % 2 else [int(i % 3 != 1) for i in range(r)]
        samples.append(
            Sample(
                prompt_ids=[rng.randrange(100, 2**20) for _ in range(p)],
                output_ids=[rng.randrange(100, 2**20) for _ in range(r)],
                output_logprobs=[-rng.random() * m for m in mask],
                finish_reason=("abort" if r == 0 else ("stop", "length")[b % 2]),
                output_mask=mask,
                trajectory=TrajectoryStats(1 + b % 3, b % 2, int(b % 4 == 1), ("", "turns", "tokens")[b % 3]),
            )
        )
    return build_rollout_batch(samples, PAD, N)


def deliver(rank, world_size):
    import torch

    from megaopd.batching.delivery import broadcast_header, deliver_rows, row_users
    from megaopd.batching.owners import RankPlace, RowOwners, WorldLayout
    from megaopd.parallel.dist import device

    full = full_batch()
    batch = broadcast_header(lambda: full, PAD, N, device())
    owner_layout = WorldLayout(tuple(RankPlace(r // 2, r % 2 == 0) for r in range(world_size)))
    owners = RowOwners(OWNER, rank // 2, 2, rank % 2 == 0, owner_layout)
    teacher_layout = WorldLayout(tuple(RankPlace(r, True) for r in range(world_size)))
    received = deliver_rows(batch, row_users(owners, owner_layout, [(SHARES, teacher_layout)]), device())
    held = list(range(8)) if batch.held_B is None else batch.held_B.nonzero().flatten().tolist()
    idx = torch.tensor(held, dtype=torch.long)
    others = torch.tensor([b for b in range(8) if b not in held], dtype=torch.long)
    try:
        batch.check_held(list(range(8)), "everything")
        refused = None
    except KeyError as e:
        refused = str(e)

    def bad():
        raise ValueError("sample 3: output_mask does not match")

    try:
        broadcast_header(bad, PAD, N, device())
        failed = None
    except (ValueError, RuntimeError) as e:  # rank 0 its own error, the others one naming rank 0
        failed = f"{type(e).__name__}: {e}"
    return {
        "failed": failed,
        "held": held,
        "received_bytes": received,
        "refused": refused,
        "tokens": torch.equal(batch.tokens_BS[idx], full.tokens_BS[idx]),
        "mask": torch.equal(batch.loss_mask_BT[idx], full.loss_mask_BT[idx]),
        "logprobs": torch.equal(batch.engine_logprobs_BT[idx], full.engine_logprobs_BT[idx]),
        "others_empty": bool((batch.tokens_BS[others] == PAD).all() and (batch.loss_mask_BT[others] == 0).all()),
        "header": (
            torch.equal(batch.prompt_lens_B, full.prompt_lens_B)
            and torch.equal(batch.response_lens_B, full.response_lens_B)
            and torch.equal(batch.student_lens_B, full.student_lens_B)
            and torch.equal(batch.group_ids_B, full.group_ids_B)
            and batch.finish_reasons == full.finish_reasons
            and batch.trajectories == full.trajectories
            and batch.tokens_BS.shape == full.tokens_BS.shape
        ),
        "real_tokens": [int(full.prompt_lens_B[b] + full.response_lens_B[b]) for b in range(8)],
    }
