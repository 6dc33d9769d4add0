"""The HF <-> Megatron mapping as pure functions (no process group, no megatron import).

pytest tests/models/test_weights.py -x
"""

import pytest
import torch

from megaopd.models.hf_config import padded_vocab_size, read_hf_config
from megaopd.models.presets import preset_config
from megaopd.models.weights import (
    FC1,
    QKV,
    VOCAB,
    Placement,
    hf_shapes,
    merge_shards,
    shard_hf_weights,
    shard_tensor,
    stage_rules,
)


def _cfg(name):
    return read_hf_config(preset_config(name))


def _random_hf(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf_shapes(cfg).items()}


@pytest.mark.parametrize(
    "name,ep",
    [
        ("tiny-qwen2", 1),
        ("tiny-qwen2-tied", 1),
        ("tiny-llama", 1),
        ("tiny-qwen3", 1),
        ("tiny-qwen3-tied", 1),
        ("tiny-qwen3-moe", 1),
        ("tiny-qwen3-moe", 2),
        ("tiny-qwen3-moe", 8),
    ],
)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_shard_then_merge_is_identity(name, ep, tp, pp):
    cfg = _cfg(name)
    hf = _random_hf(cfg)
    rebuilt = {}
    for pp_rank in range(pp):
        for ep_rank in range(ep):
            shards = [
                shard_hf_weights(
                    hf, cfg, Placement(tp_rank=r, tp_size=tp, pp_rank=pp_rank, pp_size=pp, ep_rank=ep_rank, ep_size=ep)
                )
                for r in range(tp)
            ]
            for rule in stage_rules(cfg, pp_rank, pp, ep_rank=ep_rank, ep_size=ep):
                if rule.export and (rule.expert or ep_rank == 0):  # EP ranks replicate the rest
                    for n, t in zip(rule.hf, merge_shards(rule, [s[rule.megatron] for s in shards], cfg)):
                        assert n not in rebuilt, f"{n} exported twice"
                        rebuilt[n] = t
    assert rebuilt.keys() == hf.keys()
    for n in hf:
        assert torch.equal(rebuilt[n], hf[n]), n


def test_qkv_is_interleaved_by_query_group():
    cfg = _cfg("tiny-qwen2")  # 6 heads, 2 groups, head dim 16: per group [q q q k v] heads
    hf = _random_hf(cfg)
    rule = next(r for r in stage_rules(cfg) if r.kind == QKV and r.megatron.endswith("weight"))
    q, k, v = (hf[n] for n in rule.hf)
    d, nq = 16, 3
    full = shard_tensor(rule, [q, k, v], cfg, 0, 1)
    expected = torch.cat([q[0 : nq * d], k[0:d], v[0:d], q[nq * d : 2 * nq * d], k[d : 2 * d], v[d : 2 * d]])
    assert torch.equal(full, expected)
    # TP=2: each rank holds one whole query group.
    assert torch.equal(shard_tensor(rule, [q, k, v], cfg, 1, 2), expected[(nq + 2) * d :])


def test_fc1_is_gate_then_up_per_rank():
    cfg = _cfg("tiny-qwen2")
    rule = next(r for r in stage_rules(cfg) if r.kind == FC1)
    gate, up = torch.randn(192, 96), torch.randn(192, 96)
    s1 = shard_tensor(rule, [gate, up], cfg, 1, 2)
    assert torch.equal(s1, torch.cat([gate[96:], up[96:]]))


def test_vocab_padding_rows_are_zero_and_trimmed():
    cfg = _cfg("tiny-qwen2")  # vocab 300 -> 512 rows at TP=2
    rule = next(r for r in stage_rules(cfg) if r.kind == VOCAB)
    w = torch.randn(300, 96)
    shards = [shard_tensor(rule, [w], cfg, r, 2) for r in range(2)]
    assert all(s.shape == (padded_vocab_size(300, 2) // 2, 96) for s in shards)
    assert torch.count_nonzero(shards[1][300 - 256 :]) == 0
    assert torch.equal(merge_shards(rule, shards, cfg)[0], w)


def test_tied_embeddings_rules():
    cfg = _cfg("tiny-qwen2-tied")
    names_pp1 = [r.megatron for r in stage_rules(cfg, 0, 1)]
    assert "output_layer.weight" not in names_pp1  # megatron shares the embedding on one stage
    last = stage_rules(cfg, 1, 2)
    out = [r for r in last if r.megatron == "output_layer.weight"]
    assert len(out) == 1 and out[0].hf == ("model.embed_tokens.weight",) and not out[0].export
    assert "lm_head.weight" not in hf_shapes(cfg)


def test_pp_stages_own_disjoint_global_layers():
    cfg = _cfg("tiny-qwen2")  # 4 layers
    s0 = {n for r in stage_rules(cfg, 0, 2) for n in r.hf}
    s1 = {n for r in stage_rules(cfg, 1, 2) for n in r.hf}
    assert "model.layers.1.mlp.down_proj.weight" in s0 and "model.layers.2.mlp.down_proj.weight" in s1
    assert not s0 & s1
    assert [r.megatron for r in stage_rules(cfg, 1, 2)][0] == "decoder.layers.0.input_layernorm.weight"


def test_fused_norm_names_for_transformer_engine():
    cfg = _cfg("tiny-llama")
    names = {r.megatron for r in stage_rules(cfg, fused_norms=True)}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any(n.endswith("input_layernorm.weight") for n in names)


def test_shape_mismatch_names_the_tensor():
    cfg = _cfg("tiny-llama")
    hf = _random_hf(cfg)
    hf["model.layers.1.mlp.up_proj.weight"] = torch.randn(10, 64)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight has shape \(10, 64\)"):
        shard_hf_weights(hf, cfg, Placement())


def test_save_hf_dir_shards_and_index(tmp_path, monkeypatch):
    from megaopd.models import hf_io

    monkeypatch.setattr(hf_io, "SHARD_BYTES", 3000)  # a few tensors per file
    cfg = _cfg("tiny-llama")
    hf = {n: t for n, t in _random_hf(cfg).items() if "layers.0." in n or "norm" in n}
    hf_io.save_hf_dir(str(tmp_path), iter(hf.items()))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert hf_io.INDEX_NAME in files and not any(f.endswith(".tmp") for f in files)
    back = hf_io.HFWeights(str(tmp_path))
    assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
    assert len({back.files[n] for n in hf}) > 2


def test_qwen3_qk_norms_are_replicated_per_layer():
    cfg = _cfg("tiny-qwen3")
    rules = {r.megatron: r for r in stage_rules(cfg, 1, 2)}
    r = rules["decoder.layers.0.self_attention.q_layernorm.weight"]
    assert r.hf == ("model.layers.2.self_attn.q_norm.weight",) and r.kind == "replicated"
    assert rules["decoder.layers.1.self_attention.k_layernorm.weight"].hf == ("model.layers.3.self_attn.k_norm.weight",)
    assert hf_shapes(cfg)["model.layers.0.self_attn.q_norm.weight"] == (32,)  # head_dim, not hidden / heads
    assert not any("bias" in n for n in hf_shapes(cfg))


def test_moe_experts_split_over_ep_ranks():
    cfg = _cfg("tiny-qwen3-moe")  # 8 experts
    rules = {r.megatron: r for r in stage_rules(cfg, 0, 1, ep_rank=1, ep_size=2)}
    fc1 = rules["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert fc1.expert and fc1.kind == FC1
    assert fc1.hf == ("model.layers.0.mlp.experts.4.gate_proj.weight", "model.layers.0.mlp.experts.4.up_proj.weight")
    assert "decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight" not in rules
    router = rules["decoder.layers.0.mlp.router.weight"]
    assert router.hf == ("model.layers.0.mlp.gate.weight",) and not router.expert
    # Transformer Engine cannot fuse a MoE layer's pre-MLP norm into a linear: it keeps its own name.
    fused = {r.megatron for r in stage_rules(cfg, fused_norms=True)}
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in fused
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in fused


def _fewer_layers(cfg):
    import dataclasses

    return dataclasses.replace(cfg, num_layers=cfg.num_layers - 1)


def test_weights_left_over_name_the_tensors_and_the_config_field():
    """Issue 53: config.json naming fewer layers than the weights hold trained the smaller model silently."""
    from megaopd.models.weights import WeightsMismatch, check_all_used

    cfg = _cfg("tiny-llama")
    names = list(_random_hf(cfg))
    with pytest.raises(WeightsMismatch) as e:
        check_all_used(names, _fewer_layers(cfg), "HF")
    last = cfg.num_layers - 1
    per_layer = sum(1 for n in names if n.startswith(f"model.layers.{last}."))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"HF: {per_layer} tensors the model does not use (model.layers.{last}."), msg
    assert f"num_hidden_layers: {cfg.num_layers - 1} but the weights hold {cfg.num_layers} layers" in msg
    # and the other way: the config names a layer the weights lack
    short = [n for n in names if not n.startswith(f"model.layers.{last}.")]
    with pytest.raises(WeightsMismatch, match=rf"{per_layer} tensors missing .*num_hidden_layers: {cfg.num_layers} "):
        check_all_used(short, cfg, "HF")


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen2-tied", "tiny-qwen3", "tiny-qwen3-moe"])
def test_complete_weights_and_the_expected_unused_pass(name):
    from megaopd.models.weights import check_all_used

    cfg = _cfg(name)
    names = list(_random_hf(cfg)) + ["model.rotary_emb.inv_freq", "model.layers.0.self_attn.rotary_emb.inv_freq"]
    if cfg.tie_word_embeddings:
        names.append("lm_head.weight")  # a copy of embed_tokens some savers write
    check_all_used(names, cfg, "HF")


def test_an_hf_folder_with_a_stray_tensor_or_missing_experts_is_refused_before_any_copy(tmp_path):
    from megaopd.models import hf_io
    from megaopd.models.weights import WeightsMismatch, load_hf_weights

    cfg = _cfg("tiny-qwen3-moe")
    hf = _random_hf(cfg)
    hf["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(2)
    hf_io.save_hf_dir(str(tmp_path), iter(hf.items()))
    with pytest.raises(WeightsMismatch, match=rf"^{tmp_path}: 1 tensors the model does not use \(model.layers.0.mlp"):
        load_hf_weights(torch.nn.Module(), hf_io.HFWeights(str(tmp_path)), cfg, Placement())
    import dataclasses

    with pytest.raises(WeightsMismatch, match=rf"num_experts: {cfg.num_experts + 1} but the weights hold "):
        load_hf_weights(
            torch.nn.Module(),
            hf_io.HFWeights(str(tmp_path)),
            dataclasses.replace(cfg, num_experts=cfg.num_experts + 1),
            Placement(),
        )


def test_config_json_against_a_checkpoints_saved_shapes():
    from megaopd.models.weights import WeightsMismatch, check_config_matches_shards

    cfg = _cfg("tiny-llama")
    L, H, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    saved = {
        "embedding.word_embeddings.weight": (padded_vocab_size(cfg.vocab_size, 1), H),
        "decoder.layers.self_attention.linear_proj.weight": (L, H, cfg.num_attention_heads * cfg.head_dim),
        "decoder.layers.mlp.linear_fc2.weight": (L, H, F),
        "decoder.final_layernorm.weight": (H,),
    }
    check_config_matches_shards(saved, cfg, "CKPT")
    with pytest.raises(WeightsMismatch, match=rf"^CKPT: .*num_hidden_layers: {L - 1} but the shards hold {L} layers"):
        check_config_matches_shards(saved, _fewer_layers(cfg), "CKPT")
    import dataclasses

    with pytest.raises(WeightsMismatch, match=rf"intermediate_size: {2 * F} but the shards' is {F}"):
        check_config_matches_shards(saved, dataclasses.replace(cfg, intermediate_size=2 * F), "CKPT")
