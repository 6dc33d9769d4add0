"""Config loading and start-up validation: each error is one clear message naming the key and the fix."""

import json
import os

import pytest

from megaopd.config import ConfigError, load_config
from megaopd.config.schema import MegaOPDConfig


def _hf_dir(tmp_path, name, heads=6, kv=2, layers=4, vocab=200):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "num_attention_heads": heads,
                "num_key_value_heads": kv,
                "num_hidden_layers": layers,
                "vocab_size": vocab,
            }
        )
    )
    return str(d)


@pytest.fixture
def models(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2", "golden": "1+1=2. \\boxed{2}"}) + "\n")
    return _hf_dir(tmp_path, "student"), _hf_dir(tmp_path, "teacher", heads=8, kv=4, layers=6), str(data)


def _load(models, *overrides, preset=None):
    s, t, data = models
    return load_config(
        MegaOPDConfig,
        preset,
        [f"student.path={s}", f"teacher.path={t}", f"data.sources=[{{path: {data}}}]", *overrides],
    )


def test_valid_config_with_overrides(models):
    cfg = _load(models, "run.world_size=4", "student.tp=2", "teacher.tp=4", "trainer.max_steps=3", "reference.tp=2")
    assert cfg.trainer.max_steps == 3 and cfg.teachers[0].tp == 4 and cfg.run.world_size == 4


def test_removed_key_is_one_clear_error(models, tmp_path):
    """A key megaopd no longer reads is refused with the reason, wherever it is set."""
    with pytest.raises(
        ConfigError,
        match=r"^trainer.log_interval was removed \(it was never read.*\): delete it "
        r"from the command-line overrides$",
    ):
        _load(models, "trainer.log_interval=5")
    preset = tmp_path / "old.yaml"
    preset.write_text("trainer:\n  max_steps: 7\n  log_interval: 10\n")
    with pytest.raises(ConfigError, match=f"^trainer.log_interval was removed .*: delete it from {preset}$"):
        _load(models, preset=str(preset))


def test_collapse_thresholds_are_per_rate_and_the_old_dicts_name_them(models, tmp_path):
    """metrics.collapse.<rate>.jump/level are typed fields; the old name-keyed jump/level dicts fail at load in
    one line naming the new keys, from the command line (a key under them too) or from a preset."""
    cfg = _load(models, "metrics.collapse.truncation_rate.jump=0.3", "metrics.collapse.repetition_rate.level=null")
    assert cfg.metrics.collapse.truncation_rate.jump == 0.3 and cfg.metrics.collapse.truncation_rate.level == 0.5
    assert cfg.metrics.collapse.repetition_rate.level is None and cfg.metrics.collapse.repetition_rate.jump == 0.1
    for old in ("metrics.collapse.jump={truncation_rate: 0.3}", "metrics.collapse.jump.truncation_rate=0.3"):
        with pytest.raises(
            ConfigError, match=r"^metrics.collapse.jump was removed .*metrics.collapse.truncation_rate.jump"
        ):
            _load(models, old)
    preset = tmp_path / "old.yaml"
    preset.write_text("metrics:\n  collapse:\n    level:\n      repetition_rate: 0.3\n")
    with pytest.raises(
        ConfigError, match=r"^metrics.collapse.level was removed .*repetition_rate.level instead\): del"
    ):
        _load(models, preset=str(preset))
    with pytest.raises(ConfigError, match=r"metrics.collapse.truncation_rate.jump=-0.1 must be >= 0"):
        _load(models, "metrics.collapse.truncation_rate.jump=-0.1")


def test_embedded_engine_dtype_follows_the_student(models):
    """auto: the student's dtype (what `megaopd plan` counts and build_engine is given); a named one as is."""
    assert _load(models).embedded_engine_dtype() == "float32"
    assert _load(models, "student.dtype=bfloat16").embedded_engine_dtype() == "bfloat16"
    assert _load(models, "student.dtype=bfloat16", "rollout.engine_dtype=float32").embedded_engine_dtype() == "float32"
    # the parity probe's tight float32 bound needs both in float32
    assert _load(models).parity_dtype() == "float32"
    assert _load(models, "rollout.engine_dtype=bfloat16").parity_dtype() == "bfloat16"
    assert _load(models, "student.dtype=bfloat16", "rollout.engine_dtype=float32").parity_dtype() == "bfloat16"


def test_preset_then_override(models, tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("trainer:\n  max_steps: 7\n  eval_interval: 2\noptimizer:\n  lr: 2.0e-6\n")
    cfg = _load(models, "trainer.eval_interval=5", preset=str(preset))
    assert (cfg.trainer.max_steps, cfg.trainer.eval_interval, cfg.optimizer.lr) == (7, 5, 2e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["run.world_size=2", "student.tp=4"], "student.tp=4 does not divide the 6 attention heads"),
        (
            ["run.world_size=3", "student.tp=3", "reference.tp=3"],
            "student.tp=3 does not divide the 2 query (KV) groups",
        ),
        (["run.world_size=3", "student.pp=3"], "student.pp=3 does not divide the 4 layers"),
        (["run.world_size=3", "teacher.tp=2"], "run.world_size=3 is not a multiple of teacher.tp*teacher.pp=2"),
        (["run.world_size=2", "student.tp=2"], "reference must share the student's layout"),
        (["trainer.max_step=3"], "unknown config key 'trainer.max_step'"),
        (["trainer.max_steps=three"], "bad value for 'trainer.max_steps'"),
        (["optimizer.lr=-1"], "optimizer.lr=-1.0 must be positive"),
        (["trainer.max_steps"], "is not of the form key=value"),
        (["rollout.engine_dtype=fp8"], "rollout.engine_dtype='fp8': choose auto, float32, bfloat16, float16"),
    ],
)
def test_validation_errors(models, overrides, message):
    with pytest.raises(ConfigError) as e:
        _load(models, *overrides)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_key_lists_accepted_keys(models):
    with pytest.raises(ConfigError, match="this section accepts: .*max_steps"):
        _load(models, "trainer.max_step=3")


def test_missing_paths(models, tmp_path):
    s, _, _ = models
    with pytest.raises(ConfigError, match="teacher.path='/nonexistent' does not exist"):
        load_config(MegaOPDConfig, None, [f"student.path={s}", "teacher.path=/nonexistent"])
    with pytest.raises(ConfigError, match="loss 'stable_opd' needs a teacher: set teacher.path"):
        _load(models, "teacher.path=''")
    with pytest.raises(ConfigError, match="config file 'nope.yaml' does not exist"):
        load_config(MegaOPDConfig, "nope.yaml", [])
    with pytest.raises(ConfigError, match="no config.json in"):
        load_config(MegaOPDConfig, None, [f"student.path={s}", f"teacher.path={tmp_path}"])


def test_model_paths_expand_home_and_variables(models, monkeypatch):
    """Presets name the cached real models as ~/.cache/megaopd/models/... (examples/real): model paths expand
    `~` and $VARIABLES as data paths do, instead of failing with "'~/...' does not exist"."""
    s, t, data = models
    name = os.path.basename(s)
    monkeypatch.setenv("HOME", os.path.dirname(s))
    monkeypatch.setenv("MEGAOPD_TEST_MODELS", os.path.dirname(t))
    cfg = load_config(
        MegaOPDConfig,
        None,
        [f"student.path=~/{name}", "teacher.path=$MEGAOPD_TEST_MODELS/teacher", f"data.sources=[{{path: {data}}}]"],
    )
    assert (cfg.student.path, cfg.teachers[0].path) == (s, t)


def test_missing_data_and_bad_loss(models):
    s, t, _ = models
    with pytest.raises(ConfigError, match="data source '/nope.jsonl' does not exist"):
        _load(models, "data.sources=[{path: /nope.jsonl}]")
    with pytest.raises(ConfigError, match="unknown loss 'stabel_opd'"):
        _load(models, "loss.name=stabel_opd")
    with pytest.raises(ConfigError, match="unknown key"):
        _load(models, "loss.config={sft_weigth: 0.2}")


@pytest.fixture
def moe_models(tmp_path):
    """A dense student and a MoE teacher with 8 experts (the Qwen3-MoE config fields megaopd reads)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2", "golden": "1+1=2. \\boxed{2}"}) + "\n")
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 2,
                "vocab_size": 200,
                "num_local_experts": 8,
            }
        )
    )  # as transformers 5 saves it (released configs say num_experts)
    return _hf_dir(tmp_path, "student"), str(teacher), str(data)


def test_teacher_expert_parallel_layout(moe_models):
    cfg = _load(moe_models, "run.world_size=4", "teacher.ep=4")
    assert cfg.teachers[0].ep == 4 and cfg.student.ep == 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["run.world_size=2", "student.ep=2", "reference.ep=2"], "student.ep=2 but"),
        (
            ["run.world_size=2", "student.ep=2", "reference.ep=2"],
            "has no experts: expert parallelism is for MoE models",
        ),
        (["run.world_size=3", "teacher.ep=3"], "teacher.ep=3 does not divide the 8 experts"),
        (["run.world_size=4", "teacher.tp=2", "teacher.ep=4"], "teacher.ep=4 does not divide the data-parallel size 2"),
        (["run.world_size=2", "reference.ep=2"], "reference.tp/pp/ep=(1, 1, 2) differ from student.tp/pp/ep=(1, 1, 1)"),
    ],
)
def test_expert_parallel_errors(moe_models, overrides, message):
    with pytest.raises(ConfigError) as e:
        _load(moe_models, *overrides)
    assert message in str(e.value)
    assert "\n" not in str(e.value)
