"""Spawned workers of tests/scoring/test_remote_teacher.py (module level: imported by name)."""

from __future__ import annotations

import torch


def _batch(seed: int = 0, B: int = 6, vocab: int = 256):
    """Prompt + response rows of different lengths, right-padded with 0, as build_rollout_batch lays them."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(3, 9, (B,), generator=g)
    response_lens = torch.randint(1, 12, (B,), generator=g)
    response_lens[1] = 0  # an aborted request: nothing to score
    S = int((prompt_lens + response_lens).max())
    tokens = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        n = int(prompt_lens[b] + response_lens[b])
        tokens[b, :n] = torch.randint(3, vocab, (n,), generator=g)
    mask = torch.zeros(B, S - 1)
    for b in range(B):
        p, r = int(prompt_lens[b]), int(response_lens[b])
        mask[b, p - 1 : p - 1 + r] = 1
    return tokens, prompt_lens, response_lens, mask


def in_job_vs_remote(rank, world_size, teacher_dir, urls, topk):
    """The in-job Megatron teacher (TP=world_size) and the same weights behind `megaopd serve`, on the same
    responses: TokenScores of both, on rank 0."""
    from megaopd.batching.micro_batches import ScoringBatches
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.scoring import PipelineRunner
    from megaopd.scoring.config import TeacherConfig
    from megaopd.scoring.passes import ScoreRequest, score_tokens
    from megaopd.scoring.remote import RemoteTeacher, ServerPolicy
    from megaopd.trainer.roles import load_role_model

    pgs = initialize_actor_layout(Layout(world_size, 1))
    teacher = load_role_model(TeacherConfig(path=teacher_dir, tp=world_size), pgs, trainable=False)
    runner = PipelineRunner(teacher.model, pgs, teacher.hf.vocab_size)
    tokens, p, r, mask = _batch()
    in_job = score_tokens(runner, tokens, ScoringBatches(4), ScoreRequest(1.0, topk=topk))
    remote = (
        RemoteTeacher("t", urls, ServerPolicy(rows_per_request=2)).score(tokens, p, r, topk=topk) if rank == 0 else None
    )
    return (in_job, remote, mask) if rank == 0 else None


OWNER = [1, 0, 0, 1, 1, 0]  # actor DP rank that trains each row of _batch() (non-contiguous on purpose)
ROUTE = ["a", "b", "a"]  # teacher of each prompt (2 samples each): a has rows 0, 1, 4, 5; b rows 2, 3


def served_owned_rows(rank, world_size, urls, topk):
    """Two served teachers through TeacherSet with actor DP=2 over `world_size` ranks (replica = rank % 2, so
    each replica has world_size / 2 ranks): per rank, the teacher scores it holds (and its owned rows); then
    the error every rank raises when the teacher's servers are dead."""
    from megaopd.batching.micro_batches import ScoringBatches
    from megaopd.batching.owners import RowOwners
    from megaopd.rollout.records import RolloutBatch
    from megaopd.scoring.passes import ScoreRequest
    from megaopd.scoring.remote import RemoteTeacher, ServerPolicy
    from megaopd.scoring.scorers import WholeBatch
    from megaopd.scoring.teachers import TeacherScoring, TeacherSet

    tokens, p, r, mask = _batch()
    B = tokens.shape[0]
    batch = RolloutBatch(tokens, mask, torch.zeros_like(mask), p, r, ["stop"] * B, torch.arange(B) // 2)
    owners = RowOwners(tuple(OWNER), rank % 2, 2, sends=rank < 2)
    teachers = TeacherSet([RemoteTeacher(n, urls, ServerPolicy(rows_per_request=2)) for n in ("a", "b")])
    batch.teacher_rows = teachers.route(ROUTE, 2)
    batches, request = ScoringBatches(2), ScoreRequest(1.0, topk=topk)
    scores = teachers.score(WholeBatch(batch=batch, owners=owners, batches=batches), TeacherScoring(request=request))
    dead = TeacherSet([RemoteTeacher("a", ["http://127.0.0.1:9"], ServerPolicy(retries=0))])
    try:
        batch.teacher_rows = {"a": list(range(B))}
        dead.score(WholeBatch(batch=batch, owners=owners, batches=batches), TeacherScoring(request=request))
        error = None
    except Exception as e:  # noqa: BLE001 - the test reads it
        error = f"{type(e).__name__}: {e}"
    return {"mine": owners.rows(), "scores": scores, "error": error}
