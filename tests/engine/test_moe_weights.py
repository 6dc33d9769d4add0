"""The model runner loads a Qwen3-MoE model's per-expert HF names into transformers 5's fused expert
tensors: after loading another model's checkpoint tensors, its log-probs equal that model's own HF forward."""

import pytest
import torch

from megaopd.engine.config import EmbeddedEngineConfig
from megaopd.engine.memory import EngineReleasedError
from megaopd.engine.weights import fused_expert_slots
from megaopd.models.hf_io import HFWeights
from megaopd.models.presets import make_hf_model
from megaopd.rollout.embedded import EmbeddedEngine
from megaopd.rollout.protocol import SamplingParams
from tests.engine._models import hf_logprobs

PROBE = [1, 5, 9, 14, 30, 41, 7, 7, 60, 2, 80, 81]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """Two random tiny Qwen3-MoE models of one config (8 experts, top 2): the engine's and the "actor's"."""
    root = tmp_path_factory.mktemp("qwen3_moe")
    dirs = [str(root / f"m{seed}") for seed in (0, 1)]
    for seed, d in enumerate(dirs):
        make_hf_model("tiny-qwen3-moe", d, seed=seed)
    return dirs


def engine_gap(engine, hf_dir) -> float:
    engine_lp = torch.tensor(engine.prompt_logprobs(PROBE)[1:], dtype=torch.float64)
    ref = hf_logprobs(hf_dir, PROBE[:1], PROBE[1:], 1.0)
    return (engine_lp - ref).abs().max().item()


def test_per_expert_names_are_the_checkpoint_names(moe_dirs):
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=moe_dirs[0], load_tokenizer=False))
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in engine.model.state_dict())  # fused in transformers 5
    specs = engine.param_specs()
    weights = HFWeights(moe_dirs[0])
    assert set(specs) == set(weights.keys())  # the names update_weights takes are exactly the checkpoint's
    assert all(specs[n][0] == tuple(weights[n].shape) for n in specs)
    slot = fused_expert_slots(engine.model.state_dict())["model.layers.1.mlp.experts.5.up_proj.weight"]
    assert slot.param == "model.layers.1.mlp.experts.gate_up_proj" and slot.index == (5, slice(32, 64))


def test_update_with_per_expert_tensors_equals_hf_forward(moe_dirs):
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=moe_dirs[0], load_tokenizer=False))
    assert engine_gap(engine, moe_dirs[0]) < 1e-4
    assert engine_gap(engine, moe_dirs[1]) > 1e-2  # the two models differ
    other = HFWeights(moe_dirs[1])
    engine.update_weights(((n, other[n]) for n in sorted(other.keys())), weight_version="v1")
    # gate and up land in their halves of gate_up_proj, down_proj per expert: the engine is model 1.
    assert engine_gap(engine, moe_dirs[1]) < 1e-4
    samples = engine.generate([PROBE[:4]], SamplingParams(n=2, max_new_tokens=6, seed=3))
    for s in samples:
        ref = hf_logprobs(moe_dirs[1], s.prompt_ids, s.output_ids, 1.0)
        assert (ref - torch.tensor(s.output_logprobs, dtype=torch.float64)).abs().max().item() < 1e-4


def test_discarded_fused_experts_stay_stale_until_every_expert_is_loaded(moe_dirs):
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=moe_dirs[0], load_tokenizer=False, release_weights="discard"))
    weights = HFWeights(moe_dirs[1])
    engine.release_memory()
    engine.resume_memory()
    last = "model.layers.1.mlp.experts.7.down_proj.weight"
    engine.update_weights((n, weights[n]) for n in sorted(weights.keys()) if n != last)
    with pytest.raises(EngineReleasedError, match=last):
        engine.prompt_logprobs(PROBE)
    engine.update_weights([(last, weights[last])])
    assert engine_gap(engine, moe_dirs[1]) < 1e-4
