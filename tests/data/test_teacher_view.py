"""A teacher's prefix of a data row (teacher.context over the row's fields, or its own chat template) and the
row's TeacherView: what the teacher reads, checked against the templates rendered by hand."""

import pytest

from megaopd.data.config import DataConfig
from megaopd.data.openr1 import GoldenRecord
from megaopd.data.teacher_view import TeacherPrompt, check_context_fields, context_fields, render_context, teacher_view
from megaopd.data.tokenize import build_examples
from tests.data.tiny_vocab import qwen_math_base, r1_distill

REC = GoldenRecord("a", "Solve 3x + 5 = {20}.", "5", golden="3x = 15, so x = 5.")


def _example(cfg=None, teacher=None):
    return build_examples([REC], "s", cfg or DataConfig(), qwen_math_base(), teacher)[0][0]


def test_context_fields_are_filled_by_str_replace_and_latex_braces_stay():
    cfg = DataConfig()
    ex = _example(cfg)
    assert context_fields("{golden}\n{problem} {golden} \\frac{1}{2}") == ["golden", "problem"]
    text = render_context("Known: {golden}\n{problem} ({answer}) {instruction}", ex, cfg)
    assert text == f"Known: {REC.golden}\n{REC.problem} (5) {cfg.instruction}"
    check_context_fields("teacher", "{golden} {problem} {answer} {instruction}")
    with pytest.raises(ValueError, match=r"teacher.context names \{hint\}, .*use \{problem\}, \{golden\}"):
        check_context_fields("teacher", "{hint} {problem}")


def test_a_context_equal_to_the_user_format_gives_the_students_prompt_ids():
    cfg = DataConfig()
    ex = _example(cfg)
    same = TeacherPrompt(context=cfg.user_format, data=cfg, tokenizer=qwen_math_base())
    assert same.prefix_ids(ex) == ex.prompt_ids
    assert TeacherPrompt(data=cfg, tokenizer=qwen_math_base()).prefix_ids(ex) == ex.prompt_ids  # no context
    golden = TeacherPrompt(context="{golden}\n\n" + cfg.user_format, data=cfg, tokenizer=qwen_math_base())
    tok = qwen_math_base()
    want = tok.apply_chat_template(
        [{"role": "user", "content": f"{REC.golden}\n\n{REC.problem}\n{cfg.instruction}"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert golden.prefix_ids(ex) == tok(want, add_special_tokens=False)["input_ids"]


def test_own_tokenizer_renders_the_problem_in_the_teachers_template():
    cfg = DataConfig()
    ex = _example(cfg)
    own = TeacherPrompt(data=cfg, tokenizer=r1_distill(), own=True).prefix_ids(ex)
    assert r1_distill().decode(own).startswith("<｜begin▁of▁sentence｜><｜User｜>Solve")
    # data.teacher_prompt=own made the same ids at load, for a teacher of the student's tokenizer setting
    ex_own = _example(DataConfig(teacher_prompt="own"), r1_distill())
    assert TeacherPrompt(data=cfg, tokenizer=qwen_math_base()).prefix_ids(ex_own) == ex_own.teacher_prompt_ids == own


def test_a_row_without_the_field_is_one_clear_error():
    cfg = DataConfig(require_golden=False)
    ex = build_examples([GoldenRecord("b", "1 + 1?", "2")], "s", cfg, qwen_math_base())[0][0]
    with pytest.raises(ValueError, match=r"uses \{golden\} but prompt b of source 's' has no golden"):
        TeacherPrompt(context="{golden} {problem}", data=cfg, tokenizer=qwen_math_base()).prefix_ids(ex)


def test_same_tokenizer_view_is_prefix_then_the_response_unchanged():
    v = teacher_view([5, 6, 7], [9, 8])
    assert (v.ids, v.response_start, v.response_len, v.alignment) == ([5, 6, 7, 9, 8], 3, 2, None)
