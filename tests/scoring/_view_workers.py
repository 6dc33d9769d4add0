"""Spawned worker of tests/scoring/test_teacher_view.py: teachers scoring sequences of their own (a prefix of
their own, then the student's response) through TeacherSet, in-job and served."""

from __future__ import annotations

import torch

from tests.scoring._remote_workers import _batch

OWNER = [1, 0, 0, 1, 1, 0]  # actor DP rank that trains each row of _batch() (non-contiguous on purpose)
ROUTE = ["a", "b", "a"]  # teacher of each prompt (2 samples each): a (in-job) rows 0, 1, 4, 5; b (served) 2, 3
PREFIX_LENS = [13, 2, 7]  # the teachers' prefix of each prompt: longer and shorter than the student's prompts
TOPK, AT = 4, 3


def prefixes(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PREFIX_LENS]


class FixedPrompt:
    """A TeacherPrompt whose prefix of a row is the row itself (the examples here are the prefixes)."""

    cross = False  # the student's vocabulary

    def prefix_ids(self, example):
        return list(example)


def view_scores(rank, world_size, teacher_dir, urls, actor_tp, teacher_tp, pack, teacher_pp=1):
    """Actor at TP=actor_tp (its DP replicas own the rows: OWNER), in-job teacher "a" at TP=teacher_tp (another
    layout when they differ: its shares come from its own sequences' lengths), served teacher "b" at `urls`,
    both reading PREFIX_LENS-long prefixes of their own. Per rank: its owned rows and the merged TokenScores,
    then the in-job teacher alone at the student's top-AT ids (AT_IDS below) and those ids."""
    from megaopd.batching.micro_batches import ScoringBatches
    from megaopd.batching.owners import RowOwners
    from megaopd.parallel.groups import Layout, build_process_groups, initialize_actor_layout
    from megaopd.rollout.records import RolloutBatch, TokenScores
    from megaopd.scoring import PipelineRunner
    from megaopd.scoring.config import TeacherConfig
    from megaopd.scoring.passes import ScoreRequest
    from megaopd.scoring.remote import RemoteTeacher, ServerPolicy
    from megaopd.scoring.scorers import WholeBatch
    from megaopd.scoring.teachers import InJobTeacher, TeacherScoring, TeacherSet
    from megaopd.trainer.roles import load_role_model

    pgs = initialize_actor_layout(Layout(actor_tp, 1))
    same = (teacher_tp, teacher_pp) == (actor_tp, 1)
    tpgs = pgs if same else build_process_groups(Layout(teacher_tp, teacher_pp))
    teacher = load_role_model(TeacherConfig(path=teacher_dir, tp=teacher_tp, pp=teacher_pp), tpgs, trainable=False)
    V = teacher.hf.vocab_size
    tokens, p, r, mask = _batch(vocab=V)
    B, T = tokens.shape[0], tokens.shape[1] - 1
    batch = RolloutBatch(tokens, mask, torch.zeros_like(mask), p, r, ["stop"] * B, torch.arange(B) // 2)
    dp = pgs.dp.size()
    owners = RowOwners(tuple(o % dp for o in OWNER), pgs.dp.rank(), dp, pgs.tp.rank() == 0 and pgs.pp.rank() == 0)
    in_job = InJobTeacher("a", PipelineRunner(teacher.model, tpgs, V), teacher.model)
    served = RemoteTeacher("b", urls, ServerPolicy(rows_per_request=2))
    batches = ScoringBatches(2, 24 if pack else None, p + r)

    def run(members, route, topk, at_ids=None):
        teachers = TeacherSet(members, {m.name: FixedPrompt() for m in members})
        rows_of = teachers.route(route, 2)
        batch.teacher_rows = rows_of
        batch.teacher_prefixes = teachers.prefixes(prefixes(V), 2, rows_of)
        settings = TeacherScoring(
            request=ScoreRequest(1.0, topk=topk), at_ids=(lambda: at_ids) if at_ids is not None else None
        )
        return teachers.score(WholeBatch(batch=batch, owners=owners, batches=batches), settings)

    merged = run([in_job, served], ROUTE, TOPK)
    g = torch.Generator().manual_seed(11)
    at_ids_BTK = torch.randint(0, V, (B, T, AT), generator=g, dtype=torch.int32)
    mine = owners.rows()
    at = TokenScores(logprobs_BT=torch.zeros(len(mine), T), topk_ids_BTK=at_ids_BTK[mine], rows=mine)
    alone = run([in_job], ["a"] * 3, 0, at_ids=at)
    return {"mine": mine, "merged": merged, "alone": alone, "at_ids": at_ids_BTK, "vocab": V}


def cross_view_scores(rank, world_size, teacher_dir, student_dir, urls, prefixes_T, rows=None):
    """A teacher of another vocabulary, in the job (one rank) as "a" and served at `urls` as "b", through
    TeacherSet: each reads prefixes_T[prompt] (its ids) then the response re-tokenized. rows: the batch as
    (tokens, prompt_lens, response_lens) of 6 rows, 2 per prompt (default: _batch's random ids under 256). The
    merged TokenScores."""
    from megaopd.batching.micro_batches import ScoringBatches
    from megaopd.batching.owners import RowOwners
    from megaopd.data.config import DataConfig
    from megaopd.data.teacher_view import TeacherPrompt
    from megaopd.models.hf_io import load_tokenizer
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.rollout.records import RolloutBatch
    from megaopd.scoring import PipelineRunner
    from megaopd.scoring.config import TeacherConfig
    from megaopd.scoring.passes import ScoreRequest
    from megaopd.scoring.remote import RemoteTeacher, ServerPolicy
    from megaopd.scoring.scorers import WholeBatch
    from megaopd.scoring.teachers import InJobTeacher, TeacherScoring, TeacherSet
    from megaopd.trainer.roles import load_role_model

    pgs = initialize_actor_layout(Layout(1, 1))
    teacher = load_role_model(TeacherConfig(path=teacher_dir), pgs, trainable=False)
    student_tok, teacher_tok = load_tokenizer(student_dir), load_tokenizer(teacher_dir)
    tokens, p, r, mask = _batch(vocab=256)
    if rows is not None:
        tokens, p, r = rows
        mask = torch.zeros(tokens.shape[0], tokens.shape[1] - 1)
        for b in range(tokens.shape[0]):
            mask[b, int(p[b]) - 1 : int(p[b] + r[b]) - 1] = 1
    B = tokens.shape[0]
    batch = RolloutBatch(tokens, mask, torch.zeros_like(mask), p, r, ["stop"] * B, torch.arange(B) // 2)

    class Fixed(TeacherPrompt):  # the prefixes given; the views made as the trainer's
        def prefix_ids(self, example):
            return list(example)

    prompt = Fixed(data=DataConfig(), tokenizer=teacher_tok, own=True, student_tokenizer=student_tok)
    members = [InJobTeacher("a", PipelineRunner(teacher.model, pgs, teacher.hf.vocab_size), teacher.model)]
    members.append(RemoteTeacher("b", urls, ServerPolicy(rows_per_request=2)))
    teachers = TeacherSet(members, {"a": prompt, "b": prompt})
    rows_of = teachers.route(ROUTE, 2)
    batch.teacher_rows = rows_of
    batch.teacher_prefixes = teachers.prefixes(prefixes_T, 2, rows_of)
    whole = WholeBatch(batch=batch, owners=RowOwners.replicated(B, rank), batches=ScoringBatches(2, None, p + r))
    return teachers.score(whole, TeacherScoring(request=ScoreRequest(1.0, topk=TOPK), served_topk=0))
