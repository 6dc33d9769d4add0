"""An in-job teacher of another vocabulary in a layout of its own is refused at load, in one line that names
both fixes: the student's layout, or the served path (`megaopd serve` / SGLang at the teacher's own TP,
teacher.engine=remote), the way for big teachers (docs/algorithms.md 1.13)."""

import os

import pytest

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET = os.path.join(ROOT, "examples", "tiny", "cross_tokenizer.yaml")


def test_a_cross_tokenizer_teacher_at_its_own_tp_is_refused_naming_the_served_path():
    load_config(MegaOPDConfig, PRESET, []).validate()  # the preset: the teacher in the student's TP=2
    with pytest.raises(ValueError) as e:
        load_config(MegaOPDConfig, PRESET, ["teacher.tp=1"]).validate()
    line = str(e.value)
    assert "\n" not in line
    assert "set teacher.tp=2 teacher.pp=1 teacher.ep=1" in line
    assert "teacher.engine=remote teacher.urls=[http://HOST:PORT]" in line and "megaopd serve" in line
    # the served teacher of another vocabulary at any TP of its own: accepted
    served = ["teacher.tp=1", "teacher.engine=remote", "teacher.urls=[http://127.0.0.1:1]"]
    load_config(MegaOPDConfig, PRESET, served).validate()
