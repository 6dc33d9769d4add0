"""A LoRA student as the trainer builds it (trainer/roles.py, student.lora on): the optimizer holds the adapters
only, and a step changes the adapters (B from zero) and nothing of the frozen base. TP=1 and TP=2 (2 gloo workers;
megatron's distributed optimizer needs CUDA tensors: the GPU check's territory).

    pytest tests/trainer/test_lora_student.py
"""

import pytest
import torch

from megaopd.parallel.launch import spawn
from tests.trainer import _lora_workers


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megaopd.models.presets import make_hf_model

    path = str(tmp_path_factory.mktemp("lora_student") / "tiny-qwen2")
    make_hf_model("tiny-qwen2", path, seed=5)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("tp", (1, 2))
def test_only_adapters_train(hf_dir, tp):
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(6))
    for res in spawn(_lora_workers.lora_optimizer_step, world_size=2, args=(hf_dir, ids, tp), timeout=600):
        assert res["ok"] and res["grad_norm"] > 0
        assert res["held_are_adapters"] and res["held_numel"] == res["adapter_numel"]
        assert res["adapter_numel"] < res["model_numel"] // 10
        # B starts at zero, so one step moves B (and A, whose gradient is B^T g = 0 at step one, stays put)
        assert res["changed"] and all(n.endswith("adapter.lora_B") for n in res["changed"]), res["changed"]


@pytest.mark.parametrize(
    "overrides, free",
    [
        ([], True),
        (["student.lora.enabled=false"], False),
        (["reference.path=examples/tiny/models/../models/student"], False),  # another path: loaded, as named
        (["reference.path=examples/tiny/models/student"], True),
        (["teacher.path=reference", "teacher.tp=2"], False),  # an in-job teacher shares the loaded reference
    ],
)
def test_the_reference_is_the_student_with_adapters_off(overrides, free):
    """Which LoRA jobs read the reference from the student itself (roles.build_models: BaseView partner)."""
    from megaopd.config import load_config
    from megaopd.config.schema import MegaOPDConfig

    cfg = load_config(MegaOPDConfig, "examples/tiny/lora_opd.yaml", overrides)
    assert cfg.reference_is_the_base() is free
