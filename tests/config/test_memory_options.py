"""ModelConfig's memory options reach megatron: recompute (selective, full) changes no value or gradient.

One process, a tiny Qwen2 in float32 on CPU: the loss and every parameter's gradient with recomputation
equal those without it (megatron recomputes the same ops in backward; dropout is 0).
"""

import pytest
import torch

from megaopd.models.config import ModelConfig


def test_memory_option_checks():
    with pytest.raises(ValueError, match="recompute='some'"):
        ModelConfig(recompute="some")
    with pytest.raises(ValueError, match="sequence_parallel=true needs tp > 1"):
        ModelConfig(sequence_parallel=True)
    ModelConfig(tp=2, sequence_parallel=True, recompute="full")


def test_overrides_map_to_megatron_keys():
    from megaopd.models.builder import activation_memory_overrides

    assert activation_memory_overrides() == {"sequence_parallel": False}
    assert activation_memory_overrides("selective")["recompute_granularity"] == "selective"
    full = activation_memory_overrides("full", 2, True)
    assert full == {
        "sequence_parallel": True,
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 2,
    }


@pytest.mark.slow
def test_recompute_gives_same_loss_and_gradients(tmp_path, monkeypatch):
    import megatron.core.tensor_parallel.random as mrandom

    # megatron's CheckpointFunction saves and restores the CUDA RNG state around the recomputed forward;
    # a CPU-only torch has none (megaopd's CPU layer stubs the RNG tracker, not these two). Dropout is 0, so
    # no random op runs inside the recomputed region: stubbing them changes no value.
    monkeypatch.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.zeros(1))
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda *a, **k: None)
    # The recomputed forward runs inside autograd's backward, where the CPU layer's cuda->cpu device mode
    # does not reach; megatron's unfused softmax builds its causal mask with device="cuda" there.
    import megatron.core.fusions.fused_softmax as fused_softmax

    monkeypatch.setattr(
        fused_softmax, "get_default_causal_mask", lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    )
    from megaopd.models.builder import BuildOptions, activation_memory_overrides, build_gpt_model
    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.presets import make_hf_model
    from megaopd.parallel.dist import destroy_distributed, init_distributed
    from megaopd.parallel.groups import Layout, initialize_actor_layout

    make_hf_model("tiny-qwen2", str(tmp_path / "m"), seed=0)
    cfg = read_hf_config(str(tmp_path / "m"))
    init_distributed()
    try:
        pgs = initialize_actor_layout(Layout(1, 1), seed=7)
        ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(9)[None].expand(2, 9)
        results = {}
        for mode in ("none", "selective", "full"):
            torch.manual_seed(3)
            model = build_gpt_model(
                cfg, Layout(), pgs, BuildOptions(config_overrides=activation_memory_overrides(mode))
            ).train()
            assert model.config.recompute_granularity == (None if mode == "none" else mode)
            logits = model(ids, pos, None)
            loss = torch.log_softmax(logits.float(), -1)[..., : cfg.vocab_size].mean()
            loss.backward()
            results[mode] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        ref_loss, ref_grads = results["none"]
        for mode in ("selective", "full"):
            loss, grads = results[mode]
            torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
            for name, g in grads.items():
                torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=f"{mode}: {name}")
    finally:
        destroy_distributed()
