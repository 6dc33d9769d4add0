"""A teacher that reads a sequence of its own (teacher.context / tokenizer: its prefix, then the student's
response): its scores equal its own HF forward in float64 on its own tokens, moved to the student's response
positions, in-job (in the actor's layout and in another, padded and packed) and served by `megaopd serve`,
routed by source beside each other; and the move itself, position by position."""

from __future__ import annotations

import os

import pytest
import torch

from megaopd.rollout.records import RolloutBatch, TokenScores
from megaopd.scoring.views import view_rows
from tests.scoring import _view_workers as w
from tests.scoring._remote_workers import _batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEACHER = os.path.join(ROOT, "examples", "tiny", "models", "teacher")


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every test here runs on one intra-op thread (tests/conftest.py)."""


def _rollout(vocab=256):
    tokens, p, r, mask = _batch(vocab=vocab)
    B = tokens.shape[0]
    return RolloutBatch(tokens, mask, torch.zeros_like(mask), p, r, ["stop"] * B, torch.arange(B) // 2)


def test_view_rows_hold_prefix_then_response_and_move_scores_to_the_student_positions():
    batch = _rollout()
    rows = [0, 2, 3, 5]
    prefixes = [[7] * n for n in (1, 9, 4, 2)]
    view = view_rows(batch, rows, prefixes)
    T = batch.tokens_BS.shape[1] - 1
    for i, b in enumerate(rows):
        p, n = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
        response = batch.tokens_BS[b, p : p + n].tolist()
        assert view.tokens_BS[i, : len(prefixes[i]) + n].tolist() == prefixes[i] + response
        assert int(view.lengths_B[i]) == len(prefixes[i]) + n
    # A teacher's "score" at view position t: 1000 * sub-row + t; moved, the student's position of response
    # token j holds the value of the view's position of response token j (start - 1 + j in each).
    Tv = view.tokens_BS.shape[1] - 1
    values = (1000 * torch.arange(4)[:, None] + torch.arange(Tv)[None]).float()
    part = TokenScores(logprobs_BT=values, rows=[0, 1, 2, 3])
    moved = view.to_student(part.take([1, 3]), T)
    assert moved.rows == [2, 5]
    for i, (sub, b) in enumerate([(1, 2), (3, 5)]):
        p, n, v = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b]), len(prefixes[sub])
        expected = torch.zeros(T)
        expected[p - 1 : p - 1 + n] = torch.tensor([1000.0 * sub + v - 1 + j for j in range(n)])
        assert torch.equal(moved.logprobs_BT[i], expected)
    # And ids given at the student's positions land on the view's.
    ids = torch.arange(2 * T * 3).reshape(2, T, 3)
    back = view.to_view(ids, [0, 2])
    for i, sub in enumerate([0, 2]):
        b = rows[sub]
        p, n, v = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b]), len(prefixes[sub])
        assert torch.equal(back[i, v - 1 : v - 1 + n], ids[i, p - 1 : p - 1 + n])


def _hf_view_reference(batch, views_of_rows, vocab):
    """Float64 log-softmax of the HF teacher on each row's own sequence (prefix + response): per row, the
    [n, V] rows that predict its response tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float64).eval()
    out = {}
    with torch.no_grad():
        for b, prefix in views_of_rows.items():
            p, n = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
            seq = torch.tensor([prefix + batch.tokens_BS[b, p : p + n].tolist()])
            lp = model(input_ids=seq).logits[0, :-1].log_softmax(-1)
            out[b] = lp[len(prefix) - 1 : len(prefix) - 1 + n]
    return out


@pytest.fixture(scope="module")
def server():
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.serving.server import RolloutServer, ServeConfig

    config = ServeConfig(hf_dir=TEACHER, port=0)
    s = RolloutServer(config, engine=EmbeddedEngine(config.engine_config())).start()
    yield s
    s.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(
    "actor_tp, teacher_tp, teacher_pp, pack",
    [(1, 1, 1, False), (2, 1, 1, True), (2, 1, 2, True)],
    ids=["one-rank", "actor-tp2-teacher-dp2-packed", "actor-tp2-teacher-pp2-packed"],
)
def test_teacher_scores_its_own_sequence_as_its_hf_forward(server, actor_tp, teacher_tp, teacher_pp, pack):
    from megaopd.parallel.launch import spawn

    world = max(actor_tp, teacher_tp * teacher_pp, 2 if (teacher_tp, teacher_pp) != (actor_tp, 1) else 1)
    args = (TEACHER, [server.url], actor_tp, teacher_tp, pack, teacher_pp)
    results = spawn(w.view_scores, world, args=args, timeout=900)
    vocab = results[0]["vocab"]
    batch = _rollout(vocab)
    prefixes = w.prefixes(vocab)
    B = batch.size
    ref = _hf_view_reference(batch, {b: prefixes[b // 2] for b in range(B)}, vocab)
    for res in results:
        for key in ("merged", "alone"):
            scores = res[key]
            assert scores.rows == res["mine"]
            for i, b in enumerate(scores.rows):
                p, n = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
                got = scores.logprobs_BT[i]
                assert not got[: p - 1].any() and not got[p - 1 + n :].any()  # outside the response: 0
                if not n:  # an aborted row: nothing scored
                    continue
                want = ref[b].gather(-1, batch.tokens_BS[b, p : p + n, None])[:, 0]
                # float32 (Megatron or the server) against float64: ~1e-5 at these log-probs
                assert (got[p - 1 : p - 1 + n].double() - want).abs().max() < 5e-5, (key, b)
                if key == "merged":  # the teacher's own top-K over its own sequence
                    ids = scores.topk_ids_BTK[i, p - 1 : p - 1 + n].long()
                    assert torch.equal(ids, ref[b].topk(w.TOPK, -1).indices)
                if key == "alone":  # at the student's ids of the student's positions
                    at = res["at_ids"][b, p - 1 : p - 1 + n].long()
                    want_at = ref[b].gather(-1, at)
                    assert (scores.at_ids_logprobs_BTK[i, p - 1 : p - 1 + n].double() - want_at).abs().max() < 5e-5
