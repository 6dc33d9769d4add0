"""The optimizer's checkpoint layout. megatron's DistributedOptimizer takes CUDA parameters only, so no CPU
test can save one; its first save on an H100 failed under megatron-core 0.16's default layout
('fully_sharded_model_space': "ShardedTensor.flattened_range is not supported"). This pins what
trainer/checkpoint.py asks for, on save and on load alike; the GPU check (part c) saves and resumes it."""

from megaopd.trainer import checkpoint


class _Recorder:
    def __init__(self):
        self.calls = []

    def sharded_state_dict(self, model_sd, is_loading=False, metadata=None):
        self.calls.append((is_loading, metadata))
        return {}


def test_distributed_optimizer_layout_is_dp_reshardable(monkeypatch):
    monkeypatch.setattr(checkpoint.compat, "sharded_state_dict", lambda model, pgs: {})
    opt = _Recorder()
    checkpoint._optimizer_sd(None, opt, None, is_loading=False)
    checkpoint._optimizer_sd(None, opt, None, is_loading=True)
    assert opt.calls == [
        (False, {"distrib_optim_sharding_type": "dp_reshardable"}),
        (True, {"distrib_optim_sharding_type": "dp_reshardable"}),
    ]


class _Counter:
    """A Stateful component: what it keeps is its own business."""

    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_components_round_trip_under_their_keys():
    import json

    import pytest

    saved = checkpoint.trainer_state(
        7, 2, {"tp": 1, "pp": 1, "ep": 1}, {"data": _Counter(3), "collapse": _Counter(5)}, {"weight_version": "7"}
    )
    # The JSON layout of older checkpoints: step, world size, layout, one key per component, then metadata.
    assert list(saved) == ["step", "world_size", "layout", "data", "collapse", "weight_version"]
    state = json.loads(json.dumps(saved))
    fresh = {"data": _Counter(), "collapse": _Counter()}
    assert checkpoint.restore_components(state, fresh, "ckpt") == 7
    assert (fresh["data"].n, fresh["collapse"].n) == (3, 5)
    with pytest.raises(ValueError, match=r"ckpt/trainer_state.json has no state for \['scheduler'\]"):
        checkpoint.restore_components(state, {**fresh, "scheduler": _Counter()}, "ckpt")
    with pytest.raises(ValueError, match="would overwrite"):
        checkpoint.trainer_state(7, 2, {}, {"data": _Counter()}, {"data": 1})
