"""student.lora: off by default, and bad settings refused at load in one line naming the key and the fix."""

import pytest

from megaopd.config import ConfigError, load_config
from megaopd.config.schema import MegaOPDConfig
from tests.config.test_config import _hf_dir, _load, models, moe_models  # noqa: F401 (fixtures)

PRESET = "examples/tiny/stable_opd.yaml"
REMOTE = ["rollout.engine=remote", "rollout.urls=[http://127.0.0.1:1]"]


def refusal(overrides: list[str], preset: str | None = PRESET) -> str:
    """The ConfigError that loading `preset` with `overrides` raises (asserted to be one line)."""
    with pytest.raises(ConfigError) as e:
        load_config(MegaOPDConfig, preset, overrides)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_lora_is_off_by_default_and_loads_when_on():
    assert not load_config(MegaOPDConfig, PRESET).student.lora.enabled
    cfg = load_config(
        MegaOPDConfig, PRESET, ["student.lora.enabled=true", "student.lora.rank=8", "student.lora.targets=[qkv,fc2]"]
    )
    assert (cfg.student.lora.rank, list(cfg.student.lora.targets)) == (8, ["qkv", "fc2"])


def test_lora_on_moe_experts_refused_in_one_line(moe_models, tmp_path):  # noqa: F811
    _, moe, data = moe_models
    on = [f"student.path={moe}", f"teacher.path={moe}", f"data.sources=[{{path: {data}}}]", "student.lora.enabled=true"]
    message = refusal(on, preset=None)
    assert "LoRA on the expert linears is not supported; set student.lora.targets=[qkv,proj]" in message
    assert load_config(MegaOPDConfig, None, on + ["student.lora.targets=[qkv,proj]"]).student.lora.enabled


def test_lora_sync_resolves_per_engine():
    """rollout.lora_sync=auto: adapter for the embedded engine; remote engines keep auto, which the weight sync
    resolves from what they take (megaopd serve: adapter, SGLang: merged; tests/sync/test_lora_sync.py); auto kept
    without LoRA. adapter with a remote engine loads (megaopd serve takes it; SGLang is refused at the first sync)."""
    assert load_config(MegaOPDConfig, PRESET).rollout.lora_sync == "auto"
    on = ["student.lora.enabled=true"]
    assert load_config(MegaOPDConfig, PRESET, on).rollout.lora_sync == "adapter"
    remote = on + REMOTE
    assert load_config(MegaOPDConfig, PRESET, remote).rollout.lora_sync == "auto"
    assert load_config(MegaOPDConfig, PRESET, remote + ["rollout.lora_sync=adapter"]).rollout.sends_adapters
    assert load_config(MegaOPDConfig, PRESET, on + ["rollout.lora_sync=merged"]).rollout.lora_sync == "merged"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["student.lora.enabled=true", "student.lora.rank=0"], "student.lora.rank=0: the adapters' rank must be"),
        (["student.lora.rank=-4"], "student.lora.rank=-4"),
        (["student.lora.enabled=true", "student.lora.targets=[qkv,mlp]"], "choose from qkv, proj, fc1, fc2, all"),
        (["student.lora.enabled=true", "student.lora.targets=[]"], "student.lora.targets=[]"),
        (["student.lora.enabled=true", "student.lora.alpha=0"], "student.lora.alpha=0.0: must be positive"),
        (["student.lora.enabled=true", "student.lora.dropout=1"], "student.lora.dropout=1.0: must be in [0, 1)"),
        (
            ["student.lora.enabled=true", "student.tp=2", "reference.tp=2", "run.world_size=2"]
            + ["student.sequence_parallel=true"],
            "student.lora with student.sequence_parallel=true is not supported",
        ),
        (["rollout.lora_sync=adapter"], "rollout.lora_sync=adapter needs student.lora.enabled=true"),
        (["rollout.lora_sync=merged"], "rollout.lora_sync=merged needs student.lora.enabled=true"),
        (["student.lora.enabled=true", "rollout.lora_sync=delta"], "rollout.lora_sync='delta': choose auto"),
    ],
)
def test_bad_lora_settings_refused_in_one_line(overrides, message):
    assert message in refusal(overrides)


def test_lora_checkpoint_as_student_path_refused_without_lora(tmp_path):
    """A LoRA checkpoint (metadata 'lora') as student.path: refused at load, before any model is built, unless
    student.lora matches its adapters (roles.load_role_model then rebuilds them before the load:
    tests/trainer/test_lora_export.py)."""
    import json
    import shutil

    from megaopd.models.checkpoint import FORMAT, META_NAME, MODEL_SUBDIR

    ckpt = tmp_path / "ckpt"
    shutil.copytree("examples/tiny/models/student", ckpt)
    (ckpt / MODEL_SUBDIR).mkdir()
    lora = dict(enabled=True, rank=16, alpha=32.0, targets=["qkv", "proj", "fc1", "fc2"], dropout=0.0)
    (ckpt / META_NAME).write_text(json.dumps({"format": FORMAT, "version": 1, "lora": lora}))
    base = [f"student.path={ckpt}", f"reference.path={ckpt}", "student.tp=1", "reference.tp=1", "run.world_size=1"]
    assert "is a LoRA checkpoint (rank 16" in refusal(base)
    assert "differs from the adapters saved" in refusal(base + ["student.lora.enabled=true", "student.lora.rank=8"])
    cfg = load_config(MegaOPDConfig, PRESET, base + ["student.lora.enabled=true"])
    assert cfg.student.lora.rank == 16
