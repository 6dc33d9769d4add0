"""A Qwen3-MoE actor at expert parallelism 2 (alone and with PP=2, where the stages' expert tensors are
collected over PP) and at TP=2 syncs into the embedded engine: the gather over
TP and EP returns every HF tensor bit-exactly on every rank, and the engine, which keeps transformers 5's
fused expert tensors, then scores like an independent HF forward of the actor's weights (< 1e-4)."""

import pytest
import torch

from megaopd.models.presets import make_hf_model
from megaopd.parallel.launch import spawn
from tests.engine._models import hf_logprobs
from tests.sync import _workers


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,pp,ep", [(2, 1, 1, 2), (2, 2, 1, 1), (4, 1, 2, 2)])
def test_moe_actor_syncs_into_embedded_engine(tmp_path, world, tp, pp, ep):
    hf_dir = str(tmp_path / "moe")
    make_hf_model("tiny-qwen3-moe", hf_dir, seed=0)
    out = spawn(
        _workers.moe_actor_to_embedded, world, args=(hf_dir, str(tmp_path / "perturbed"), tp, pp, ep), timeout=600
    )[0]
    assert out["mismatches"] == [] and out["names_ok"]
    assert out["weight_version"] == "moe"
    probe = _workers.PROBE[0]
    ref = hf_logprobs(out["perturbed_dir"], probe[:1], probe[1:], 1.0)
    before = hf_logprobs(hf_dir, probe[:1], probe[1:], 1.0)
    engine = torch.tensor(out["engine_lp"], dtype=torch.float64)
    assert (engine - ref).abs().max().item() < 1e-4
    assert (engine - before).abs().max().item() > 1e-2  # the push changed the engine's weights
