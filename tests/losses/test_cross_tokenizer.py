"""opd under a teacher with another tokenizer, end to end on real tokenizers: the tiny student's responses,
re-tokenized by the tiny teacher_xtok's tokenizer, aligned (megaopd.data.alignment), the teacher's log-probs
spread and placed in [B, T] rows with prompt and padding, then the opd loss; against a float64 reference
written at the level of text spans (the teacher's log-probs summed over ITS tokens of each span, the
student's over its own), which never sees the spread values.

    pytest tests/losses/test_cross_tokenizer.py
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from tests.data.conftest import ROOT, TINY_DATA, TINY_TOKENIZER

XTOK_TOKENIZER = os.path.join(ROOT, "examples", "tiny", "tokenizer_xtok")
PROMPT = 3  # positions before each response (mask off)


def _rows():
    from megaopd.data.alignment import align_response, spread_span_logprobs
    from megaopd.models.hf_io import load_tokenizer

    student, teacher = load_tokenizer(TINY_TOKENIZER), load_tokenizer(XTOK_TOKENIZER)
    with open(os.path.join(TINY_DATA, "opd.jsonl")) as f:
        texts = [json.loads(next(f))["generations"][0] for _ in range(3)]
    g = torch.Generator().manual_seed(7)
    rows = []
    for text in texts:
        ids = student.encode(text, add_special_tokens=False)[: 20 + 7 * len(rows)] + [student.eos_token_id]
        _, t_ids, al = align_response(student, teacher, ids)
        teacher_lp = -torch.rand(len(t_ids), generator=g, dtype=torch.float64) * 4
        old_lp = -torch.rand(len(ids), generator=g, dtype=torch.float64) * 4
        values, spans = spread_span_logprobs(teacher_lp, al)
        rows.append(dict(ids=ids, al=al, teacher_lp=teacher_lp, old_lp=old_lp, values=values, spans=spans))
    return rows


def _batch(rows, V=256):
    B, T = len(rows), PROMPT + max(len(r["ids"]) for r in rows) + 2
    g = torch.Generator().manual_seed(8)
    batch = dict(
        ids=torch.zeros(B, T, dtype=torch.long),
        mask=torch.zeros(B, T),
        old=torch.zeros(B, T, dtype=torch.float64),
        teacher=torch.zeros(B, T, dtype=torch.float64),
        spans=torch.full((B, T), 0, dtype=torch.long),  # 0 at prompt and padding: the loss must not read them
        logits=torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2,
    )
    for b, r in enumerate(rows):
        n = len(r["ids"])
        at = slice(PROMPT, PROMPT + n)
        batch["ids"][b, at] = torch.tensor(r["ids"])
        batch["mask"][b, at] = 1
        batch["old"][b, at] = r["old_lp"]
        batch["teacher"][b, at] = r["values"]
        batch["spans"][b, at] = r["spans"]
    return batch


def _reference_loss(rows, logits, eps=0.2):
    """Token-mean PPO-clip loss with each student token's advantage = its span's (teacher's own tokens'
    log-probs summed) - (the student's old log-probs summed); tokens without a span: advantage 0."""
    total, count = 0.0, 0
    for b, r in enumerate(rows):
        al = r["al"]
        for i, token in enumerate(r["ids"]):
            s = al.student_span[i]
            if s < 0:
                adv = 0.0
            else:
                teacher_sum = sum(r["teacher_lp"][j] for j, t in enumerate(al.teacher_span) if t == s)
                student_sum = sum(r["old_lp"][k] for k, u in enumerate(al.student_span) if u == s)
                adv = teacher_sum - student_sum
            logp = F.log_softmax(logits[b, PROMPT + i], -1)[token]
            ratio = torch.exp(logp - r["old_lp"][i])
            total = total - torch.min(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
            count += 1
    return total / count


def test_opd_over_real_tokenizer_spans_matches_the_text_span_reference():
    from megaopd.losses import LossInputs, build_loss

    rows = _rows()
    assert any(len(set(r["al"].student_span)) < len(r["ids"]) - 1 for r in rows)  # spans of several tokens
    assert all(r["al"].student_span[-1] == -1 for r in rows)  # the student's <|im_end|>: no counterpart
    batch = _batch(rows)
    out = []
    for spans in (batch["spans"], None):
        logits = batch["logits"].clone().requires_grad_(True)
        inputs = LossInputs(
            logits_BTv=logits,
            token_ids_BT=batch["ids"],
            loss_mask_BT=batch["mask"],
            old_logprobs_BT=batch["old"],
            teacher_logprobs_BT=batch["teacher"],
            teacher_spans_BT=spans,
        )
        loss = build_loss("opd", {"log_entropy": False})(inputs).total
        loss.backward()
        out.append((loss.detach(), logits.grad))
    ref_logits = batch["logits"].clone().requires_grad_(True)
    ref = _reference_loss(rows, ref_logits)
    ref.backward()
    (loss, grad), (plain, _) = out
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)  # the ops compute in float32
    torch.testing.assert_close(grad, ref_logits.grad, rtol=1e-4, atol=1e-6)
    assert abs(float(loss) - float(plain)) > 1e-3  # the spans matter
