"""Settings that would fail only after the models loaded are refused at load, in one line (`megaopd config` as
`megaopd train`); command-line overrides replace or clear what a YAML set; a teacher whose embedding does not
cover the student's ids is refused before any loads."""

import json
import shutil

import pytest

from megaopd.config import ConfigError, load_config
from megaopd.config.cli import config_main
from megaopd.config.schema import MegaOPDConfig

TINY = "examples/tiny/models"
PRESET = "examples/tiny/stable_opd.yaml"


def _load(*overrides, preset=PRESET):
    return load_config(MegaOPDConfig, preset, list(overrides))


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens=0 must be at least 1"),
        ("rollout.top_p=2", "rollout.top_p=2.0 must be in (0, 1]"),
        ("rollout.top_p=0", "rollout.top_p=0.0 must be in (0, 1]"),
        ("rollout.top_p=nan", "rollout.top_p=nan must be in (0, 1]"),
        ("rollout.top_k=0", "rollout.top_k=0 must be -1 (all tokens) or a positive count"),
        ("rollout.temperature=inf", "rollout.temperature=inf must be a finite number > 0"),
        ("rollout.max_batch_size=0", "rollout.max_batch_size=0 must be at least 1"),
        ("rollout.request_timeout_s=0", "rollout.request_timeout_s=0.0 must be a finite number of seconds > 0"),
        ("rollout.parity_tolerance=-1", "rollout.parity_tolerance=-1.0 must be a finite number > 0"),
        ("validation.max_new_tokens=0", "validation.max_new_tokens=0 must be at least 1"),
        ("validation.samples=0", "validation.samples=0 must be at least 1"),
        ("validation.temperature=-0.5", "validation.temperature=-0.5 must be a finite number >= 0 (0: greedy)"),
        ("validation.max_problems=-1", "validation.max_problems=-1 must be >= 0 (0: every problem)"),
        ("validation.path=/nope.jsonl", "validation.path='/nope.jsonl' is not a file"),
        ("optimizer.min_lr=1", "optimizer.min_lr=1.0 must be in [0, optimizer.lr=0.0005]"),
        ("optimizer.adam_beta2=1", "optimizer.adam_beta2=1.0 must be in [0, 1)"),
        ("optimizer.clip_grad=nan", "optimizer.warmup_steps and optimizer.clip_grad must be >= 0"),
    ],
)
def test_bad_settings_refused_at_load_in_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        _load(override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_megaopd_config_refuses_them_in_one_line(capsys):
    assert config_main([PRESET, "rollout.top_p=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "megaopd config: rollout.top_p=2.0 must be in (0, 1] (1.0: the whole distribution)"


def test_switching_the_loss_resets_its_config():
    """The YAML sets stable_opd's loss.config: loss.name=opd drops it instead of failing with "unknown key(s)
    ['ref_kl_weight', 'sft_weight'] for OPDConfig"."""
    cfg = _load("loss.name=opd")
    assert cfg.loss.name == "opd" and cfg.loss.config == {}
    cfg = _load("loss.config.eps_high=0.3", "loss.name=opd")  # given in any order: the reset comes first
    assert cfg.loss.config == {"eps_high": 0.3}
    cfg = _load("loss.name=stable_opd", "loss.config.sft_weight=0.2")  # the same name: the YAML's keys stay
    assert cfg.loss.config == {"sft_weight": 0.2, "ref_kl_weight": 0.01}


@pytest.mark.parametrize("override", ["loss.config={}", "loss.config=null", "loss.config=", "~loss.config"])
def test_loss_config_can_be_cleared(override):
    assert _load(override).loss.config == {}


def test_empty_string_clears_a_path():
    """`validation.path=''` in a shell reaches the program as `validation.path=`: both clear the path (omegaconf
    alone fails with "Incompatible value 'None'")."""
    assert _load("validation.path=").validation.path == ""
    assert _load("validation.path=''").validation.path == ""
    assert _load("~validation.path").validation.path == ""  # the schema's default
    assert _load("validation={}").validation.max_new_tokens == 1024  # a section: back to its defaults
    assert _load("~trainer.max_steps").trainer.max_steps == 100


def test_a_number_cannot_be_emptied():
    with pytest.raises(
        ConfigError,
        match=r"^trainer.max_steps cannot be empty: give it a value \(e.g. "
        r"trainer.max_steps=40\), or ~trainer.max_steps for its default$",
    ):
        _load("trainer.max_steps=")
    with pytest.raises(ConfigError, match="unknown config key 'trainer.max_stepz'"):
        _load("~trainer.max_stepz")


@pytest.fixture
def small_vocab_teacher(tmp_path):
    """The tiny teacher with an embedding of 200 rows: the student's tokenizer emits ids up to 255."""
    teacher = tmp_path / "teacher"
    shutil.copytree(f"{TINY}/teacher", teacher)
    cfg = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**cfg, "vocab_size": 200}))
    return str(teacher)


def test_teacher_with_a_smaller_vocabulary_is_refused_before_any_model_loads(small_vocab_teacher):
    with pytest.raises(ConfigError) as e:
        _load(f"teacher.path={small_vocab_teacher}")
    assert str(e.value) == (
        f"teacher {small_vocab_teacher} has vocab_size=200 (config.json) but the student's tokenizer "
        f"({TINY}/student) emits ids up to 255: the loss reads the teacher's log-probs at every id the student "
        f"samples, so its embedding needs a row for each; use a teacher of the student's vocabulary "
        f"(vocab_size >= 256)"
    )
    _load(f"teacher.path={small_vocab_teacher}", "loss.name=sft")  # sft reads no teacher


def test_gkd_needs_the_students_padded_vocabulary(tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(f"{TINY}/teacher", teacher)
    cfg = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**cfg, "vocab_size": 384}))  # covers the ids, pads wider
    _load(f"teacher.path={teacher}")  # opd-style losses read the teacher at the sampled ids: fine
    with pytest.raises(
        ConfigError,
        match=r"^gkd reads the teacher's whole logits .* vocab_size=384 \(padded 512 "
        r"at tp=2\) .* vocab_size=256 \(padded 256\)",
    ):
        _load(f"teacher.path={teacher}", preset="examples/tiny/gkd.yaml")
