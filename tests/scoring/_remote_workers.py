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
        mask[b, p - 1:p - 1 + r] = 1
    return tokens, prompt_lens, response_lens, mask


def in_job_vs_remote(rank, world_size, teacher_dir, urls, topk):
    """The in-job Megatron teacher (TP=world_size) and the same weights behind `megaopd serve`, on the same
    responses: TokenScores of both, on rank 0."""
    from megaopd.config.model import TeacherConfig
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.scoring import PipelineRunner, score_tokens
    from megaopd.scoring.remote import RemoteTeacher
    from megaopd.trainer.roles import load_role_model

    pgs = initialize_actor_layout(Layout(world_size, 1))
    teacher = load_role_model(TeacherConfig(path=teacher_dir, tp=world_size), pgs, trainable=False)
    runner = PipelineRunner(teacher.model, pgs, teacher.hf.vocab_size)
    tokens, p, r, mask = _batch()
    in_job = score_tokens(runner, tokens, 4, 1.0, topk=topk)
    remote = RemoteTeacher("t", urls, rows_per_request=2).score(tokens, p, r, topk=topk) if rank == 0 else None
    return (in_job, remote, mask) if rank == 0 else None
