"""The permuted-vocabulary control of cross-tokenizer OPD in the quick tier (examples/tiny/README.md, "The
permuted-vocabulary control"): tools/permute_vocab.py gives the tiny teacher the same tokens under other ids,
and then

- the permuted tokenizer spells every text with the same tokens (ids perm[i]), and the permuted model gives
  every text the original model's log-probs (float64 HF forward);
- the cross-tokenizer path on it (cross_teacher_view: decode, re-tokenize, align by characters; the teacher's
  log-probs spread over the spans; opd's span rewards and advantages) gives every regular token exactly the
  same-tokenizer opd's teacher log-prob, reward, advantage, loss and gradient (float64, token for token). The
  one difference is the student's end-of-turn token, which the other vocabulary's text never contains: no
  span, advantage 0 (docs/algorithms.md 1.13; the tiny models give it log-probs of about -1e-6, so the
  tiny runs cannot see it).

    pytest tests/data/test_permute_vocab.py
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from tests.data.conftest import ROOT, TINY_DATA, TINY_TOKENIZER

sys.path.insert(0, os.path.join(ROOT, "tools"))
TEACHER = os.path.join(ROOT, "examples", "tiny", "models", "teacher")


@pytest.fixture(scope="module")
def permuted(tmp_path_factory):
    """(the permuted teacher's folder, perm) of examples/tiny/models/teacher."""
    from permute_vocab import permute_model

    out = str(tmp_path_factory.mktemp("teacher_perm"))
    return out, permute_model(TEACHER, out, seed=3)


def _texts(n: int = 4) -> list[str]:
    with open(os.path.join(TINY_DATA, "opd.jsonl")) as f:
        rows = [json.loads(next(f)) for _ in range(n)]
    return [r["generations"][0] for r in rows] + ["<think>\nso 3 + 4 = 7</think> The answer is 7."]


def test_permuted_tokenizer_spells_every_text_with_the_same_tokens(permuted):
    from megaopd.models.hf_io import load_tokenizer

    out, perm = permuted
    assert sorted(perm) == list(range(256)) and sum(i != p for i, p in enumerate(perm)) > 200
    tok, ptok = load_tokenizer(TINY_TOKENIZER), load_tokenizer(out)
    for text in _texts():
        ids = tok.encode(text, add_special_tokens=False)
        assert ptok.encode(text, add_special_tokens=False) == [perm[i] for i in ids]
    chat = [{"role": "user", "content": "2 + 2?"}]
    a = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert a == ptok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ptok(a, add_special_tokens=False)["input_ids"] == [
        perm[i] for i in tok(a, add_special_tokens=False)["input_ids"]
    ]
    assert (ptok.eos_token_id, ptok.pad_token_id) == (perm[tok.eos_token_id], perm[tok.pad_token_id])
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["eos_token_id"] == perm[tok.eos_token_id]


def test_permuted_teacher_gives_every_text_the_same_logprobs(permuted):
    from transformers import AutoModelForCausalLM

    from megaopd.models.hf_io import load_tokenizer

    out, perm = permuted
    tok = load_tokenizer(TINY_TOKENIZER)
    ids = tok.encode(_texts(1)[0], add_special_tokens=False)[:60] + [tok.eos_token_id]
    lps = []
    for path, seq in ((TEACHER, ids), (out, [perm[i] for i in ids])):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        with torch.no_grad():
            lp = model(torch.tensor([seq])).logits[0, :-1].log_softmax(-1)
        lps.append(lp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0])
    torch.testing.assert_close(lps[0], lps[1], rtol=0, atol=1e-12)


def test_span_opd_of_a_permuted_vocabulary_is_same_tokenizer_opd_token_for_token(permuted):
    from megaopd.data.alignment import spread_span_logprobs
    from megaopd.data.teacher_view import cross_teacher_view
    from megaopd.losses import LossInputs, build_loss
    from megaopd.models.hf_io import load_tokenizer

    out, perm = permuted
    tok, ptok = load_tokenizer(TINY_TOKENIZER), load_tokenizer(out)
    g = torch.Generator().manual_seed(11)
    P, V = 3, 256  # prompt positions before each response (mask off), the vocabulary
    rows = []
    for k, text in enumerate(_texts()):
        ids = tok.encode(text, add_special_tokens=False)[: 25 + 9 * k] + [tok.eos_token_id]
        view = cross_teacher_view([perm[1]], ids, tok, ptok)  # a one-token prefix, then the re-tokenized response
        al = view.alignment
        # the same tokens under the permuted ids, every regular token a span of its own, <|im_end|> none
        assert view.ids[view.response_start :] == [perm[i] for i in ids[:-1]]
        assert al.student_span == [*range(len(ids) - 1), -1] and al.teacher_span == list(range(len(ids) - 1))
        # the teacher's log q of each of its tokens = same-tokenizer opd's of the student's token it spells
        q = -torch.rand(len(ids), generator=g, dtype=torch.float64) * 3
        spread, spans = spread_span_logprobs(q[:-1].clone(), al)
        rows.append((ids, q, spread, spans))
    B, T = len(rows), P + max(len(r[0]) for r in rows) + 2
    ids_BT, mask_BT = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.float64)
    same_BT, cross_BT = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    spans_BT = torch.full((B, T), -1, dtype=torch.long)
    for b, (ids, q, spread, spans) in enumerate(rows):
        at = slice(P, P + len(ids))
        ids_BT[b, at], mask_BT[b, at] = torch.tensor(ids), 1
        same_BT[b, at], cross_BT[b, at], spans_BT[b, at] = q, spread, spans
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    # on-policy (the first update of a step): ratio 1, no clipping, every token's gradient is its advantage's
    old_BT = logits.log_softmax(-1).gather(-1, ids_BT[..., None])[..., 0]
    results = []
    for teacher_BT, spans in ((same_BT, None), (cross_BT, spans_BT)):
        x = logits.clone().requires_grad_(True)
        inputs = LossInputs(
            logits_BTv=x,
            token_ids_BT=ids_BT,
            loss_mask_BT=mask_BT,
            old_logprobs_BT=old_BT,
            teacher_logprobs_BT=teacher_BT,
            teacher_spans_BT=spans,
        )
        result = build_loss("opd", {"log_entropy": False})(inputs)
        loss, metrics = result.total, result.metrics
        loss.backward()
        results.append((loss.detach(), x.grad, metrics))
    (same_loss, same_grad, same_m), (cross_loss, cross_grad, cross_m) = results
    eos_BT = (ids_BT == tok.eos_token_id) & (mask_BT > 0)
    regular_BT = (mask_BT > 0) & ~eos_BT
    # every regular token: the teacher log-prob, and so its gradient row, exactly the same-tokenizer one
    assert torch.equal(same_BT[regular_BT], cross_BT[regular_BT])
    torch.testing.assert_close(cross_grad[regular_BT], same_grad[regular_BT], rtol=0, atol=1e-15)
    # the end-of-turn token: no span, advantage 0 (its gradient row 0), while same-tokenizer opd rewards it
    assert (cross_grad[eos_BT] == 0).all() and (same_grad[eos_BT].abs().sum(-1) > 0).all()
    # the loss and reward differ by the end-of-turn tokens' terms alone
    n = float(mask_BT.sum())
    same_eos_reward = float((same_BT - old_BT)[eos_BT].sum())
    torch.testing.assert_close(
        float(cross_m["opd/reward_mean"]) * n, float(same_m["opd/reward_mean"]) * n - same_eos_reward, rtol=1e-9, atol=0
    )
    assert float(cross_m["opd/unaligned_frac"]) == pytest.approx(len(rows) / n)
    assert same_loss.dtype == cross_loss.dtype == torch.float64


def test_permute_vocab_refuses_a_tokenizer_of_another_size_without_writing(tmp_path):
    from permute_vocab import main

    src = tmp_path / "src"
    shutil.copytree(TEACHER, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["vocab_size"] = 320
    (src / "config.json").write_text(json.dumps(cfg))
    assert main(["--src", str(src), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_the_control_merges_spans_k_at_a_time_on_both_sides():
    """examples/tiny/xtok_control.py's coarser spans (perm_spanK): span s becomes s // k for the student's and
    the teacher's tokens alike, tokens without a span stay without."""
    from megaopd.data.alignment import SpanAlignment

    sys.path.insert(0, os.path.join(ROOT, "examples", "tiny"))
    from xtok_control import coarsen

    al = SpanAlignment(student_span=[0, 1, 1, 2, 3, 4, -1], teacher_span=[0, 1, 2, 3, 4], n_spans=5)
    two = coarsen(al, 2)
    assert (two.student_span, two.teacher_span, two.n_spans) == ([0, 0, 0, 1, 1, 2, -1], [0, 0, 1, 1, 2], 3)
    assert coarsen(al, 1) == al
