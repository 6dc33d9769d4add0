"""Answer extraction (metrics.reward.extract): each mode on the kinds of response real models give, through
math-verify in-process and through the helper process; the found-count warning; the job config's key."""

import pytest

from megaopd.config import load_config
from megaopd.config.load import ConfigError
from megaopd.config.schema import MegaOPDConfig
from megaopd.metrics import EXTRACTIONS, RewardConfig, extract_and_verify, few_answers_warning, math_verify_reward
from tests.trainer.tiny_models import ROOT

BOXED = "Halving gives \\boxed{\\frac{1}{2}}."
ANSWER_IS = "Tom has 40 apples and buys 2 more. The answer is 42."
LAST_NUMBER = "Tom has 3 apples and buys 4 more, so 3 + 4 = 7 apples."  # SmolLM2-style: no box, no anchor
LATEX = "Solving the equation we get $x = \\frac{3}{4}$ at the end."
FINAL_LATEX = "so the final answer is $\\sqrt{2}$."
NOTHING = "I am not sure what to say."

# (mode, response, gold, correct, extracted)
CASES = [
    ("boxed", BOXED, "0.5", True, "\\frac{1}{2}"),
    ("boxed", ANSWER_IS, "42", False, None),  # the paper's rule: no box, no answer
    ("boxed", LAST_NUMBER, "7", False, None),
    ("boxed", "first \\boxed{42}, no wait, \\boxed{43}", "42", False, "43"),  # the last box only
    ("number", ANSWER_IS, "42", True, "42"),
    ("number", LAST_NUMBER, "7", True, "7"),
    ("number", "The answer is 41.", "42", False, "41"),  # found, wrong
    ("number", "The answer is 42. Checking: 6*7=42, plus 1 is 43", "42", True, "42"),  # the anchor wins
    ("number", BOXED, "0.5", False, None),  # number reads plain numbers only (any reads both)
    ("number", NOTHING, "1", False, None),
    ("latex", LATEX, "3/4", True, "x = \\frac{3}{4}"),
    ("latex", BOXED, "1/2", True, "\\frac{1}{2}"),
    ("latex", FINAL_LATEX, "\\sqrt{2}", True, "\\sqrt{2}"),
    ("latex", ANSWER_IS, "42", False, None),
    ("answer_is", ANSWER_IS, "42", True, "42"),
    ("answer_is", FINAL_LATEX, "\\sqrt{2}", True, "\\sqrt{2}"),
    ("answer_is", LAST_NUMBER, "7", False, None),  # no "answer": nothing
    ("answer_is", LATEX, "3/4", False, None),
    ("any", BOXED, "0.5", True, "\\frac{1}{2}"),
    ("any", ANSWER_IS, "42", True, "42"),
    ("any", LAST_NUMBER, "7", True, "7"),
    ("any", LATEX, "3/4", True, "x = \\frac{3}{4}"),
    ("any", NOTHING, "1", False, None),
]


@pytest.mark.parametrize("mode, response, gold, correct, extracted", CASES)
def test_each_mode_on_real_strings(mode, response, gold, correct, extracted):
    v = extract_and_verify(response, gold, RewardConfig(extract=mode, isolation="none"))
    assert (v.correct, v.extracted, v.found) == (correct, extracted, extracted is not None)
    assert math_verify_reward(response, gold, RewardConfig(extract=mode, isolation="none")) == float(correct)


@pytest.mark.parametrize("isolation", ["process", "signal"])
def test_every_mode_through_the_bounded_paths(isolation):
    """The helper process's line protocol carries the mode and the extracted text both ways."""
    for mode, response, gold, correct, extracted in CASES:
        v = extract_and_verify(response, gold, RewardConfig(extract=mode, isolation=isolation))
        assert (v.correct, v.extracted) == (correct, extracted), (mode, response)


def test_default_is_the_papers_boxed_rule():
    assert RewardConfig().extract == "boxed" and MegaOPDConfig().metrics.reward.extract == "boxed"
    assert math_verify_reward(ANSWER_IS, "42") == 0.0 and math_verify_reward("\\boxed{42}", "42") == 1.0


def test_long_extracted_answer_and_empty_inputs_score_zero():
    cfg = RewardConfig(extract="number", isolation="none", max_answer_chars=5)
    assert extract_and_verify("The answer is 1234567.", "1234567", cfg).correct is False
    assert extract_and_verify("", "1", RewardConfig(extract="any", isolation="none")).extracted is None
    assert not extract_and_verify("The answer is 42.", "", RewardConfig(extract="number", isolation="none")).correct


def test_bad_mode_is_one_clear_error():
    with pytest.raises(ValueError, match=r"metrics.reward.extract='last': choose one of boxed, latex, number"):
        RewardConfig(extract="last")


def test_few_answers_warning():
    msg = few_answers_warning(0, 50, "boxed", "--extract ")
    assert msg.startswith("0 of 50 responses had a \\boxed{} answer (extract=boxed)")
    assert "--extract number" in msg and "\n" not in msg
    assert "had a number (extract=number)" in few_answers_warning(4, 50, "number", "metrics.reward.extract=")
    assert few_answers_warning(5, 50, "boxed", "--extract ") is None  # 10% is enough
    assert few_answers_warning(0, 0, "boxed", "--extract ") is None
    assert set(EXTRACTIONS) == {"boxed", "latex", "number", "answer_is", "any"}


def test_job_config_key():
    preset = f"{ROOT}/examples/tiny/stable_opd.yaml"
    cfg = load_config(MegaOPDConfig, preset, ["metrics.reward.extract=number", "metrics.reward.timeout_s=2"])
    assert (cfg.metrics.reward.extract, cfg.metrics.reward.timeout_s) == ("number", 2.0)
    assert load_config(MegaOPDConfig, preset).metrics.reward.extract == "boxed"
    with pytest.raises(ConfigError, match="metrics.reward.extract='last'"):
        load_config(MegaOPDConfig, preset, ["metrics.reward.extract=last"])
