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
    assert opt.calls == [(False, {"distrib_optim_sharding_type": "dp_reshardable"}),
                         (True, {"distrib_optim_sharding_type": "dp_reshardable"})]
