"""A LoRA student's weight sync into the embedded engine (megaopd.sync.WeightSync, rollout.lora_sync): the adapters
alone (after the base, on the first push) or every weight merged. Either way the engine's log-probs equal the
actor's after each of two pushes (float32, < 1e-4: the parity bound), at TP=1 and TP=2 (2 gloo workers); a steady
adapter push sends about 10% of a merged one on the tiny model (rank 4 on all linears, hidden 64; at 7B, rank 16:
about 1%). The settings a job cannot run are refused at load (tests/config covers the messages).

    pytest tests/sync/test_lora_sync.py
"""

import pytest

from megaopd.parallel.launch import spawn
from tests.sync import _workers
from tests.trainer.tiny_models import make_tiny_pair


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return make_tiny_pair(str(tmp_path_factory.mktemp("lora_sync")))[0]


@pytest.mark.slow
@pytest.mark.parametrize("tp", (1, 2))
def test_lora_sync_parity_both_modes(student, tp):
    got = {}
    for mode in ("adapter", "merged"):
        got[mode] = spawn(_workers.lora_actor_to_embedded, 2, args=(student, tp, mode), timeout=600)[0]
        for push in got[mode]:
            assert push["gap"] < 1e-4, (mode, tp, push)
    first, steady = got["adapter"]
    merged = got["merged"][1]["bytes"]
    assert first["adapter_bytes"] > 0 and first["bytes"] == merged + first["adapter_bytes"]  # base, then adapter
    assert steady["bytes"] == steady["adapter_bytes"] < merged / 5
    assert [p["adapter_bytes"] for p in got["merged"]] == [0, 0]
    assert [p["version"] for p in got["adapter"]] == ["1", "2"]


def test_adapter_sync_needs_transports_that_take_adapters():
    """Only kinds marked `adapters` (in_process) take rollout.lora_sync=adapter; another engine's transport is
    refused in one line naming the fix, before anything is sent (remote engines are refused at load already)."""
    from megaopd.rollout.config import RolloutConfig
    from megaopd.sync import WeightSync
    from megaopd.sync.weight_sync import TRANSPORT_KINDS

    assert [k.name for k in TRANSPORT_KINDS.values() if k.adapters] == ["in_process"]

    class Target:
        def __init__(self, transports):
            self.weight_transports = transports

    class Engine:
        def __init__(self, *transports):
            self.targets = [Target(transports)]

        def weight_targets(self):
            return self.targets

    adapter = RolloutConfig(lora_sync="adapter")
    assert list(WeightSync(Engine("in_process"), adapter, 0)._targets_by_transport()) == ["in_process"]
    with pytest.raises(
        ValueError, match="the dist_group transport sends full weights only; set rollout.lora_sync=merged"
    ):
        WeightSync(Engine("dist_group"), adapter, 0)._targets_by_transport()
    assert list(WeightSync(Engine("dist_group"), RolloutConfig(lora_sync="merged"), 0)._targets_by_transport())
