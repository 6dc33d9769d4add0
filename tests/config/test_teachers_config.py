"""Teacher sections: engine megatron|remote, urls, the teachers list and data.sources[].teacher routing,
with one clear error for what a served teacher cannot do."""

import os

import pytest

from megaopd.config import ConfigError, load_config
from megaopd.config.schema import MegaOPDConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "tiny")
REMOTE = ["teacher.engine=remote", "teacher.urls=[http://127.0.0.1:30000]"]


def _load(preset, overrides=()):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return load_config(MegaOPDConfig, os.path.join(TINY, preset), list(overrides))
    finally:
        os.chdir(cwd)


def test_defaults_and_remote():
    one = _load("stable_opd.yaml")
    # `teacher:` is folded into the one list while loading; the section itself is left empty.
    assert [(t.name, t.engine) for t in one.teachers] == [("teacher", "megatron")] and not one.teacher.configured
    t = _load("stable_opd.yaml", REMOTE).teachers[0]
    assert t.engine == "remote" and t.urls == ["http://127.0.0.1:30000"]
    assert _load("stable_opd.yaml", ["teacher.name=math"]).teachers[0].name == "math"
    two = _load("two_teachers.yaml")
    assert [t.name for t in two.teachers] == ["arith", "algebra"]
    assert [s.teacher for s in two.data.sources] == ["arith", "algebra"]


@pytest.mark.parametrize(
    "preset, overrides, message",
    [
        ("stable_opd.yaml", REMOTE + ["rollout.temperature=0.7"], "SGLang scores .* at temperature 1 only"),
        ("lsm_student_topk.yaml", REMOTE, "cannot score the teacher at the student's top-k"),
        (
            "gkd.yaml",
            ["teacher.engine=remote", "teacher.urls=[http://h:1]", "teacher.tp=1", "student.tp=1", "reference.tp=1"],
            "cannot give the full logits",
        ),
        ("stable_opd.yaml", ["teacher.engine=remote"], "has no urls"),
        ("stable_opd.yaml", ["teacher.urls=[http://h:1]"], "set engine=remote"),
        ("stable_opd.yaml", ["teacher.engine=sglang"], "choose megatron"),
        ("two_teachers.yaml", ["teacher.path=examples/tiny/models/teacher"], "both `teacher` and `teachers`"),
        ("two_teachers.yaml", ["data.sources=[{path: examples/tiny/data/algebra.jsonl}]"], "names no teacher"),
        (
            "two_teachers.yaml",
            ["data.sources=[{path: examples/tiny/data/algebra.jsonl, teacher: code}]"],
            "not among the teachers",
        ),
    ],
)
def test_refusals_are_one_clear_line(preset, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _load(preset, overrides)
