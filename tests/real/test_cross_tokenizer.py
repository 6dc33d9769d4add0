"""SmolLM2 as student with a teacher of another real tokenizer: SmolLM2-135M-Instruct put onto Qwen2's vocabulary
(151,936 ids, llama.cpp's vocabulary GGUF checked against llama.cpp's reference tokenizations; tools/fetch_smollm2.py
--qwen2-teacher). Real texts through both real byte-level BPEs: the teacher's scores of its own sequence (its
chat template's prompt, then the response re-tokenized by Qwen2's tokenizer), in the job and served by `megaopd
serve`, sum over each aligned span to its transformers float64 log-prob of the span's tokens; and two
cross-tokenizer Stable-OPD steps of `megaopd train` (teacher.tokenizer=own) with the pruned SmolLM2 student."""

from __future__ import annotations

import math

import pytest
import torch

from tests.real import reference
from tests.real.test_train import overrides, train_two_steps

pytestmark = [pytest.mark.slow, pytest.mark.real]

RESPONSES = [
    "12 + 30 = 42, so Tom has \\boxed{42} apples.",
    "Let x be the number: 3x − 7 = 11 ⇒ x = 6. Answer: 6 ✓",
    "The sea is vast and blue 🌊.\n\nIt hums   quietly at night.",
    "数学: 7 × 8 = 56. The answer is \\boxed{56}.",
    "",
    "Ünïcödé     spaces\tand tabs — done.",
]
"""Two responses per prompt of reference.CHATS: arithmetic, Unicode math, emoji, CJK, whitespace runs, an empty one."""


@pytest.fixture(scope="module")
def qwen2_teacher(smollm2) -> str:
    return reference.install(qwen2_teacher=True)


def _rows(student_tok, stop_id: int):
    """The batch as build_rollout_batch lays it: prompt-major, 2 samples per prompt, right-padded; a response
    ends at the stop token except the empty one."""
    seqs, prompt_lens, response_lens = [], [], []
    for b, text in enumerate(RESPONSES):
        prompt = reference.chat_ids(student_tok, reference.CHATS[b // 2])
        response = student_tok.encode(text, add_special_tokens=False) + ([stop_id] if text else [])
        seqs.append(prompt + response)
        prompt_lens.append(len(prompt))
        response_lens.append(len(response))
    tokens = torch.full((len(seqs), max(map(len, seqs))), stop_id, dtype=torch.long)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = torch.tensor(s)
    return tokens, torch.tensor(prompt_lens), torch.tensor(response_lens)


def test_span_logprobs_in_job_and_served_are_the_teachers_hf_forward(smollm2, qwen2_teacher):
    from megaopd.data.alignment import align_response
    from megaopd.models.hf_io import load_tokenizer
    from megaopd.parallel.launch import spawn
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.serving.server import RolloutServer, ServeConfig
    from tests.scoring import _view_workers as w

    student_tok, teacher_tok = load_tokenizer(smollm2), load_tokenizer(qwen2_teacher)
    assert len(student_tok) == 49152 and len(teacher_tok) == 151936
    tokens, p, r = _rows(student_tok, student_tok.eos_token_id)
    prefixes = [reference.chat_ids(teacher_tok, chat) for chat in reference.CHATS]
    config = ServeConfig(hf_dir=qwen2_teacher, port=0)
    server = RolloutServer(config, engine=EmbeddedEngine(config.engine_config())).start()
    try:
        scores = spawn(
            w.cross_view_scores, 1, args=(qwen2_teacher, smollm2, [server.url], prefixes, (tokens, p, r)), timeout=1200
        )[0]
    finally:
        server.shutdown()
    model = reference.load_hf(qwen2_teacher)
    checked, merged = 0, 0
    for b in range(tokens.shape[0]):
        P, n = int(p[b]), int(r[b])
        spans = scores.spans_BT[b]
        assert (spans[: P - 1] == -1).all() and (spans[P - 1 + n :] == -1).all()
        if n == 0:
            continue
        text, t_ids, alignment = align_response(student_tok, teacher_tok, tokens[b, P : P + n].tolist())
        assert text == RESPONSES[b]  # the stop token is markup: not in the text, never aligned
        assert spans[P - 1 : P - 1 + n].tolist() == alignment.student_span
        prefix = prefixes[b // 2]
        t_lp = reference.token_logprobs(model, prefix + t_ids, first=len(prefix))
        got = scores.logprobs_BT[b, P - 1 : P - 1 + n].double()
        for k in range(alignment.n_spans):
            want = sum(float(t_lp[j]) for j, s in enumerate(alignment.teacher_span) if s == k)
            have = sum(float(got[j]) for j, s in enumerate(alignment.student_span) if s == k)
            assert abs(have - want) < 1e-3, (b, k, have, want)  # float32 Megatron / engine vs float64 HF
            checked += 1
        assert all(float(got[j]) == 0.0 for j, s in enumerate(alignment.student_span) if s < 0)
        merged += n - alignment.n_spans
    assert checked > 40 and merged > 0  # the two tokenizations do cut these texts differently


def test_two_cross_tokenizer_stable_opd_steps(smollm2_student, qwen2_teacher, tmp_path):
    run = tmp_path / "run"
    args = overrides(smollm2_student, qwen2_teacher, str(run)) + ["teacher.tokenizer=own"]
    log, steps = train_two_steps(args, run, timeout=1800)
    assert "[vocab] the teacher has another tokenizer (49152 student ids, 151936 teacher ids" in log, log[-4000:]
    for m in steps.values():
        assert math.isfinite(m["rollout/teacher_logprob_mean"]), m
    line = [ln for ln in log.splitlines() if "student tokens a span" in ln]
    print(
        "cross-tokenizer stable_opd on SmolLM2 with a Qwen2-vocabulary teacher: "
        + (line[0].strip() + "; " if line else "")
        + "; ".join(
            f"step {s}: loss {m['loss/total']:.4f}, teacher log-prob {m['rollout/teacher_logprob_mean']:.3f}, "
            f"{m['time/step']:.1f} s"
            for s, m in sorted(steps.items())
        )
    )
