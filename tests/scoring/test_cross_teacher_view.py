"""A teacher of another vocabulary reading its own sequence (its prefix, then the response re-tokenized in its
tokens): on the student's tokens of every aligned span, the spread log-probs sum to the teacher's own HF float64
log-prob of the span's text (its tokens of the span, after its prefix and the text before), in the job and
served by `megaopd serve`; each position carries its span; special tokens and the prompt none."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from megaopd.data.alignment import align_response
from megaopd.models.hf_io import load_tokenizer
from tests.scoring import _view_workers as w
from tests.scoring._remote_workers import _batch
from tests.trainer.tiny_models import ROOT, qwen2_config

STUDENT = os.path.join(ROOT, "examples", "tiny", "models", "student")
XTOK = os.path.join(ROOT, "examples", "tiny", "tokenizer_xtok")


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every test here runs on one intra-op thread (tests/conftest.py)."""


def make_xtok_teacher(out: str) -> str:
    """A random tiny Qwen2 over the 384 ids of examples/tiny/tokenizer_xtok (another vocabulary)."""
    from megaopd.models.presets import make_hf_model

    cfg = qwen2_config(96, 2, 4, 2, 192)
    cfg["vocab_size"] = 384
    make_hf_model(cfg, out, seed=5)
    for f in os.listdir(XTOK):
        shutil.copy(os.path.join(XTOK, f), out)
    return out


@pytest.mark.slow
def test_cross_tokenizer_teacher_span_logprobs_are_its_hf_forward(tmp_path):
    from transformers import AutoModelForCausalLM

    from megaopd.parallel.launch import spawn
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.serving.server import RolloutServer, ServeConfig

    teacher_dir = make_xtok_teacher(str(tmp_path / "teacher_xtok"))
    student_tok, teacher_tok = load_tokenizer(STUDENT), load_tokenizer(teacher_dir)
    prefixes = [teacher_tok("You are given: 2 + 3.")["input_ids"][: n + 1] for n in (6, 1, 4)]
    config = ServeConfig(hf_dir=teacher_dir, port=0)
    server = RolloutServer(config, engine=EmbeddedEngine(config.engine_config())).start()
    try:
        scores = spawn(w.cross_view_scores, 1, args=(teacher_dir, STUDENT, [server.url], prefixes), timeout=900)[0]
    finally:
        server.shutdown()
    assert scores.topk_ids_BTK is None and scores.entropy_BT is None  # another vocabulary's: dropped
    tokens, p, r, _ = _batch(vocab=256)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float64).eval()
    checked = 0
    for b in range(tokens.shape[0]):
        P, n = int(p[b]), int(r[b])
        spans = scores.spans_BT[b]
        assert (spans[: P - 1] == -1).all() and (spans[P - 1 + n :] == -1).all()  # prompt and padding: none
        if n == 0:
            continue
        _, t_ids, alignment = align_response(student_tok, teacher_tok, tokens[b, P : P + n].tolist())
        assert spans[P - 1 : P - 1 + n].tolist() == alignment.student_span
        prefix = prefixes[b // 2]
        with torch.no_grad():
            lp = model(torch.tensor([prefix + t_ids])).logits[0, :-1].log_softmax(-1)
        t_lp = lp[len(prefix) - 1 :].gather(-1, torch.tensor(t_ids)[:, None])[:, 0]
        got = scores.logprobs_BT[b, P - 1 : P - 1 + n].double()
        for k in range(alignment.n_spans):
            want = sum(float(t_lp[j]) for j, s in enumerate(alignment.teacher_span) if s == k)
            have = sum(float(got[j]) for j, s in enumerate(alignment.student_span) if s == k)
            assert abs(have - want) < 1e-4, (b, k, have, want)  # float32 scores vs float64, a few tokens summed
            checked += 1
        assert all(float(got[j]) == 0.0 for j, s in enumerate(alignment.student_span) if s < 0)
    assert checked > 10
