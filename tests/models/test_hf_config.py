"""config.json -> HFModelConfig: both RoPE layouts, supported families, one-line errors (no megatron needed).

pytest tests/models/test_hf_config.py -x
"""

import json

import pytest

from megaopd.models.hf_config import ModelConfigError, check_layout, padded_vocab_size, read_hf_config

QWEN = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    vocab_size=300,
    hidden_size=96,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=256,
)


def test_top_level_rope_theta_as_in_real_qwen25_files(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**QWEN, "rope_theta": 1000000.0, "rope_scaling": None, "torch_dtype": "bfloat16"})
    )
    cfg = read_hf_config(tmp_path)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    assert cfg.family == "qwen2" and cfg.qkv_bias and cfg.num_key_value_heads == 2 and cfg.head_dim == 16
    assert cfg.dtype == "bfloat16"


def test_transformers5_rope_parameters():
    cfg = read_hf_config({**QWEN, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}, "dtype": "float32"})
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling is None and cfg.dtype == "float32"


def test_llama3_rope_scaling_both_layouts():
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    llama = {**QWEN, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": True}
    old = read_hf_config({**llama, "rope_theta": 5e5, "rope_scaling": scaling})
    new = read_hf_config({**llama, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    assert old.rope_scaling == new.rope_scaling and old.rope_scaling.factor == 32.0
    assert old.rope_theta == new.rope_theta == 5e5
    assert not old.qkv_bias and old.tie_word_embeddings


@pytest.mark.parametrize(
    "patch,match",
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            r"unsupported architecture 'GPT2LMHeadModel'.*supported: Qwen2ForCausalLM, LlamaForCausalLM, "
            r"Qwen3ForCausalLM, Qwen3MoeForCausalLM",
        ),
        ({"architectures": None}, "unsupported architecture None"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"architectures": ["LlamaForCausalLM"], "attention_bias": True}, "attention_bias"),
        ({"hidden_size": None}, None),
    ],
)
def test_unsupported_configs_fail_with_one_line(patch, match):
    raw = {k: v for k, v in {**QWEN, **patch}.items() if v is not None or k == "architectures"}
    with pytest.raises(ModelConfigError, match=match) as e:
        read_hf_config(raw)
    assert "\n" not in str(e.value)


def test_missing_and_malformed_config(tmp_path):
    with pytest.raises(ModelConfigError, match="no HF config"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=f"{tmp_path}/config.json is not JSON .JSONDecodeError: "):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="config.json is not a JSON object"):
        read_hf_config(tmp_path / "config.json")


@pytest.mark.parametrize(
    "tp,pp,match",
    [
        (4, 1, "tp=4 does not divide num_attention_heads=6"),
        (3, 1, "tp=3 does not divide the 2 key/value heads"),
        (1, 3, "pp=3 does not divide num_hidden_layers=4"),
        (0, 1, "must be >= 1"),
    ],
)
def test_layout_errors(tp, pp, match):
    with pytest.raises(ModelConfigError, match=match):
        check_layout(read_hf_config(QWEN), tp, pp)


def test_valid_layouts_pass():
    cfg = read_hf_config(QWEN)
    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)]:
        check_layout(cfg, tp, pp)


def test_padded_vocab():
    assert padded_vocab_size(300, 1) == 384
    assert padded_vocab_size(300, 2) == 512
    assert padded_vocab_size(151936, 1) == 151936  # Qwen2.5: 128 * 1187
    assert padded_vocab_size(151936, 4) == 152064  # next multiple of 512
    assert padded_vocab_size(128256, 8) == 129024  # Llama 3: next multiple of 1024


QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000,
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
    max_position_embeddings=32768,
)  # Qwen3-8B-Base
QWEN3_MOE = dict(
    QWEN3,
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=0.001,
)  # Qwen3-30B-A3B


def test_qwen3_dense_and_moe():
    d = read_hf_config(QWEN3)
    assert d.family == "qwen3" and d.qk_layernorm and not d.qkv_bias and not d.is_moe and d.head_dim == 128
    m = read_hf_config(QWEN3_MOE)
    assert m.family == "qwen3_moe" and m.qk_layernorm and m.is_moe
    assert (m.num_experts, m.moe_topk, m.moe_intermediate_size, m.norm_topk_prob) == (128, 8, 768, True)
    assert m.head_dim * m.num_attention_heads != m.hidden_size  # 128 * 32 != 2048
    # transformers 5 writes num_local_experts on save
    raw = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    assert read_hf_config({**raw, "num_local_experts": 16}).num_experts == 16
    check_layout(m, tp=4, pp=2, ep=8)


@pytest.mark.parametrize(
    "raw,patch,match",
    [
        (QWEN3, {"attention_bias": True}, "attention_bias=true is not supported"),
        (QWEN3, {"use_sliding_window": True}, "use_sliding_window"),
        (QWEN3_MOE, {"mlp_only_layers": [0]}, "mlp_only_layers"),
        (QWEN3_MOE, {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        (QWEN3_MOE, {"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
    ],
)
def test_unsupported_qwen3_configs(raw, patch, match):
    with pytest.raises(ModelConfigError, match=match) as e:
        read_hf_config({**raw, **patch})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "raw,tp,ep,match",
    [
        (QWEN3_MOE, 1, 3, "ep=3 does not divide num_experts=128"),
        (QWEN3, 1, 2, "ep=2 but Qwen3ForCausalLM has no experts"),
        (QWEN3_MOE, 1, 0, "must be >= 1"),
    ],
)
def test_expert_layout_errors(raw, tp, ep, match):
    with pytest.raises(ModelConfigError, match=match):
        check_layout(read_hf_config(raw), tp, 1, ep)
