"""Prompt templates (student, teacher-aligned, plain) and the golden ids/loss mask."""

import pytest
import torch

from megaopd.data.config import DEFAULT_INSTRUCTION, DataConfig
from megaopd.data.openr1 import GoldenRecord
from megaopd.data.templates import encode_prompt, render_prompt, strip_think_overlap
from megaopd.data.tokenize import build_examples, golden_batch, turn_end_token

PROBLEM = "Solve for x: 3x + 5 = 20. Use {braces} as in \\frac{a}{b}."
GOLDEN = "<think>\nSubtract 5 from both sides: 3x = 20 - 5\n3x = 15\nx = 5\n</think>\nThe answer is \\boxed{5}."


def test_student_chat_template_is_applied(tok):
    text = render_prompt(PROBLEM, DataConfig(), tok)
    assert text == f"<|im_start|>user\n{PROBLEM}\n{DEFAULT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    ids = encode_prompt(text, DataConfig(), tok)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.decode(ids) == text
    sys_text = render_prompt(PROBLEM, DataConfig(system_prompt="Be brief."), tok)
    assert sys_text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_teacher_aligned_and_plain_templates(tok, teacher_tok):
    cfg = DataConfig(prompt_template="teacher")
    text = render_prompt(PROBLEM, cfg, tok, teacher_tok)
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    with pytest.raises(ValueError, match="teacher's tokenizer"):
        render_prompt(PROBLEM, cfg, tok)
    plain = DataConfig(prompt_template="plain", user_format="Q: {problem}\nA:")
    assert render_prompt(PROBLEM, plain, tok) == f"Q: {PROBLEM}\nA:"


def test_golden_loss_mask_covers_exactly_the_solution_tokens(tok):
    recs = [GoldenRecord("a", PROBLEM, "5", golden=GOLDEN), GoldenRecord("b", "Compute 1 + 1.", "2")]
    cfg = DataConfig(require_golden=False)
    exs, skipped, _ = build_examples(recs, "src", cfg, tok)
    ex = exs[0]
    assert not skipped and ex.source == "src" and not exs[1].has_golden
    ids, mask = ex.golden_ids, ex.golden_loss_mask
    assert len(ids) == len(mask) and ids[: len(ex.prompt_ids)] == ex.prompt_ids
    target = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(target) == GOLDEN + "<|im_end|>"  # solution + end of turn, nothing of the prompt
    assert target == tok(GOLDEN, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert mask == [0] * len(ex.prompt_ids) + [1] * len(target)
    with pytest.raises(ValueError, match="no golden"):
        _ = exs[1].golden_ids
    batch = golden_batch([ex, ex], pad_id=tok.pad_token_id)
    assert batch.input_ids_BT.shape == (2, len(ids)) and batch.loss_mask_BT.sum() == 2 * len(target)
    assert torch.equal(batch.lengths_B, torch.tensor([len(ids)] * 2))


def test_teacher_prompt_does_not_double_the_think_tag(tok, teacher_tok):
    cfg = DataConfig(prompt_template="teacher")
    ex = build_examples([GoldenRecord("a", PROBLEM, "5", golden=GOLDEN)], "s", cfg, tok, teacher_tok)[0][0]
    full = tok.decode(ex.golden_ids)
    assert full.count("<think>") == 1 and full.endswith("\\boxed{5}.<|im_end|>")
    assert strip_think_overlap("x\n", GOLDEN) == GOLDEN
    assert turn_end_token(teacher_tok) == "<|im_end|>"


def test_length_limits_skip_or_truncate(tok):
    recs = [GoldenRecord("a", PROBLEM, "5", golden=GOLDEN), GoldenRecord("b", "Compute 1 + 1.", "2", golden="2")]
    n_sol = len(tok(GOLDEN, add_special_tokens=False)["input_ids"]) + 1
    exs, skipped, first = build_examples(recs, "s", DataConfig(max_golden_len=n_sol - 1), tok)
    assert [e.uid for e in exs] == ["b"] and first == {f"golden over max_golden_len={n_sol - 1} tokens": "a"}
    exs, _, _ = build_examples(recs, "s", DataConfig(max_golden_len=10, golden_overflow="truncate"), tok)
    assert len(exs[0].solution_ids) == 10 and exs[0].solution_ids[-1] != tok.eos_token_id
    exs, skipped, _ = build_examples(recs, "s", DataConfig(max_prompt_len=20), tok)
    assert [e.uid for e in exs] == ["b"] and skipped["prompt over max_prompt_len=20 tokens"] == 1
