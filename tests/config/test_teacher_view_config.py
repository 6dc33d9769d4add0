"""teacher.context / teacher.tokenizer / teacher.path=reference at config load: what a user can get wrong is one
clear line naming the key and the fix."""

import os

import pytest

from megaopd.config import ConfigError, load_config
from megaopd.config.schema import MegaOPDConfig
from tests.trainer.tiny_models import ROOT

PRESET = os.path.join(ROOT, "examples", "tiny", "self_distill.yaml")


def _load(*overrides):
    cfg = load_config(MegaOPDConfig, PRESET, list(overrides))
    cfg.validate()
    return cfg


def test_the_preset_resolves_the_reference_and_its_context():
    cfg = _load()
    t = cfg.teachers[0]
    assert t.path == cfg.student.path and t.context.startswith("{golden}") and t.tokenizer == "student"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (['teacher.context="{solution} {problem}"'], r"teacher.context names \{solution\}, which a data row does not"),
        (["teacher.context={golden} {problem}"], r"is not valid YAML .*: quote the value"),
        (["teacher.tokenizer=mine"], r"teacher tokenizer='mine': choose student .* or own"),
        (["teacher.engine=remote", "teacher.urls=[http://x:1]"], r"path=reference is the reference model inside"),
        (["loss.name=gkd", "loss.config={}"], r"gkd runs the teacher in lockstep on the student's own sequence"),
        (["data.require_golden=false"], r"uses \{golden\} with data.require_golden=false"),
        # the teacher's own rows hold the golden too: 128 + 128 + 300 > the tiny models' 512 positions
        (["data.max_golden_len=300"], r"rows reach 556 tokens .*teacher.context's \{golden\}"),
    ],
)
def test_a_bad_teacher_view_is_one_line_at_load(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message) as e:
        _load(*overrides)
    assert "\n" not in str(e.value).strip()


def test_own_tokenizer_without_tokenizer_files_is_refused(tmp_path):
    folder = tmp_path / "teacher"
    folder.mkdir()
    src = os.path.join(ROOT, "examples", "tiny", "models", "teacher")
    for name in os.listdir(src):  # the weights and config, not the tokenizer
        if not name.startswith(("tokenizer", "special_tokens", "chat_template")):
            os.symlink(os.path.join(src, name), folder / name)
    with pytest.raises(
        ValueError, match=r"teacher.tokenizer=own but .* has no tokenizer .*set teacher.tokenizer=student"
    ):
        _load(f"teacher.path={folder}", "teacher.tokenizer=own")


def test_the_reference_teacher_shares_the_reference_model_only_when_it_is_the_same():
    cfg = _load()
    assert cfg.teacher_shares_reference(cfg.teachers[0])
    other_layout = _load("teacher.tp=1")  # another layout: a copy of its own
    assert not other_layout.teacher_shares_reference(other_layout.teachers[0])
    other_dtype = _load("teacher.dtype=bfloat16")
    assert not other_dtype.teacher_shares_reference(other_dtype.teachers[0])
    other = _load("teacher.path=examples/tiny/models/teacher")
    assert not other.teacher_shares_reference(other.teachers[0])


def test_a_teacher_row_is_longer_by_what_its_context_adds():
    """The preset's context "{golden}\\n\\n{problem}\\n{instruction}": the rollout row (128 + 128), the golden
    budget (256), data.instruction's characters and the template's own 3 characters."""
    cfg = _load()
    assert cfg.rollout_row_tokens() == 256
    assert cfg.teacher_row_tokens(cfg.teachers[0]) == 256 + 256 + len(cfg.data.instruction) + 3
    plain = _load('teacher.context=""')
    assert plain.teacher_row_tokens(plain.teachers[0]) == 256
    answer = _load('teacher.context="Answer: {answer}. {problem}"')
    assert answer.teacher_row_tokens(answer.teachers[0]) == 256 + 256 + len("Answer: . ")


def test_a_teachers_entry_names_itself_in_the_error():
    two = os.path.join(ROOT, "examples", "tiny", "two_teachers.yaml")
    entries = 'teachers=[{name: arith, path: examples/tiny/models/teacher, context: "{foo} {problem}"}]'
    with pytest.raises((ConfigError, ValueError), match=r"teachers\[arith\].context names \{foo\}"):
        load_config(MegaOPDConfig, two, [entries])


def test_trajectories_take_a_context_but_not_a_tokenizer_of_the_teachers_own():
    agentic = os.path.join(ROOT, "examples", "tiny", "agentic.yaml")
    load_config(MegaOPDConfig, agentic, ['teacher.context="{problem} {answer}"']).validate()
    with pytest.raises(
        ValueError, match=r"teacher.tokenizer=own with env.name=calculator: .*set teacher.tokenizer=student"
    ):
        load_config(MegaOPDConfig, agentic, ["teacher.tokenizer=own"]).validate()
