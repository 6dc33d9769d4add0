"""The embedded engine's adapter update (engine/lora.py, ModelRunner.update_adapter) against transformers in float64
with every adapted projection W + (alpha / r) B A (and against peft when installed): each update merges into the
kept base (not into the previous merge), a projection left out returns to its base, a bad update changes nothing,
and the bytes an adapter sync moves vs a full sync."""

import pytest
import torch

from megaopd.engine.lora import AdapterError, AdapterUpdate

RANK, ALPHA = 4, 8.0
PROMPT = [5, 17, 33, 8, 90, 41, 7, 64, 12, 3]
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def _adapter(hf_dir, seed, projections=PROJECTIONS):
    """peft-named random adapter tensors for every layer's `projections` of the model at hf_dir."""
    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.weights import hf_shapes

    cfg = read_hf_config(hf_dir)
    shapes = hf_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(cfg.num_layers):
        for p in projections:
            rows, cols = shapes[f"model.layers.{i}.{p}.weight"]
            out[f"base_model.model.model.layers.{i}.{p}.lora_A.weight"] = torch.randn(RANK, cols, generator=gen) * 0.3
            out[f"base_model.model.model.layers.{i}.{p}.lora_B.weight"] = torch.randn(rows, RANK, generator=gen) * 0.3
    return out


def _reference(hf_dir, adapter):
    """transformers in float64 with W + s B A merged by hand: the prompt's log-probs."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in adapter.items():
            if ".lora_A." in name:
                base = name[len("base_model.model.") :].replace(".lora_A.weight", ".weight")
                b = adapter[name.replace(".lora_A.", ".lora_B.")]
                params[base].add_((ALPHA / RANK) * b.double() @ a.double())
        ids = torch.tensor([PROMPT])
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp


@pytest.fixture
def runner(tiny_dir):
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.engine.runner import ModelRunner

    return ModelRunner(EmbeddedEngineConfig(hf_dir=tiny_dir, max_batch_size=4, load_tokenizer=False))


def _logprobs(runner):
    return torch.tensor(runner.prompt_logprobs(PROMPT)[1:], dtype=torch.float64)


def test_adapter_update_generates_with_base_plus_adapter(runner, tiny_dir):
    base = _logprobs(runner)
    assert float((base - _reference(tiny_dir, {})).abs().max()) < 1e-5
    first, second = _adapter(tiny_dir, 1), _adapter(tiny_dir, 2, PROJECTIONS[:4])  # the second: attention only
    runner.update_adapter(AdapterUpdate.of(first.items(), RANK, ALPHA, "lora-v1"))
    assert runner.weight_version == "lora-v1"
    got = _logprobs(runner)
    assert float((got - _reference(tiny_dir, first)).abs().max()) < 1e-4
    assert float((got - base).abs().max()) > 1e-2  # the adapter matters
    # the next update merges into the base, and the MLP (left out) returns to its base
    runner.update_adapter(AdapterUpdate.of(second.items(), RANK, ALPHA, "lora-v2"))
    assert float((_logprobs(runner) - _reference(tiny_dir, second)).abs().max()) < 1e-4
    # an empty adapter is the base again, bit for bit
    runner.update_adapter(AdapterUpdate.of([], RANK, ALPHA, "base"))
    assert torch.equal(_logprobs(runner), base)


def test_a_full_sync_is_the_new_base(runner, tiny_dir):
    from megaopd.models.hf_io import HFWeights

    first = _adapter(tiny_dir, 1)
    runner.update_adapter(AdapterUpdate.of(first.items(), RANK, ALPHA, "lora-v1"))
    hf = HFWeights(tiny_dir)
    runner.update_weights([(n, hf[n]) for n in hf], weight_version="full")  # the base, whole
    runner.update_adapter(AdapterUpdate.of([], RANK, ALPHA, "empty"))
    assert float((_logprobs(runner) - _reference(tiny_dir, {})).abs().max()) < 1e-5


def test_bad_adapter_updates_change_nothing(runner, tiny_dir):
    from megaopd.engine.weights import WeightMismatchError

    good = _adapter(tiny_dir, 1)
    before = _logprobs(runner)
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = [
        ({k: v for k, v in good.items() if k != a}, AdapterError, "lora_A missing"),
        ({**good, a: good[a][:2]}, AdapterError, "do not fit rank 4"),
        ({**good, a: good[a] * float("nan")}, AdapterError, "non-finite"),
        ({**good, "model.layers.0.self_attn.q_proj.weight": good[a]}, AdapterError, "not a peft LoRA name"),
        (
            {
                **good,
                a.replace("layers.0", "layers.9"): good[a],
                a.replace("layers.0", "layers.9").replace("_A", "_B"): good[a.replace("_A", "_B")],
            },
            WeightMismatchError,
            "layers.9.self_attn.q_proj.weight: no such weight",
        ),  # fmt: skip
    ]
    for tensors, error, message in cases:
        with pytest.raises(error, match=message):
            runner.update_adapter(AdapterUpdate.of(tensors.items(), RANK, ALPHA, "bad"))
        assert runner.weight_version == "default" and torch.equal(_logprobs(runner), before)
    with pytest.raises(AdapterError, match="rank=0"):
        AdapterUpdate.of(good.items(), 0, ALPHA, "bad")


def test_adapter_sync_bytes_vs_full_sync(runner, tiny_dir):
    """An adapter sync moves r (in + out) numbers per projection, a full sync every weight: here (hidden 64, 2
    layers, vocab 128, rank 4, float32) 32 KiB vs 354 KiB, 9.0%; the share falls with the width (Qwen2.5-7B, every
    linear, bf16: rank 16 77 MiB, rank 64 308 MiB, rank 128 616 MiB vs 14.2 GiB: 0.5%, 2.1%, 4.2%, from
    weights.adapter_hf_shapes and hf_shapes, measured 2026-11-29)."""
    update = AdapterUpdate.of(_adapter(tiny_dir, 1).items(), RANK, ALPHA, "v")
    full = sum(
        int(torch.tensor(shape).prod()) * torch.finfo(dtype).bits // 8 for shape, dtype in runner.param_specs().values()
    )
    assert update.nbytes() == 4 * RANK * 2 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 2 + (128 + 64))
    assert update.nbytes() == 32768 and full == 362752


def test_peft_agrees(runner, tiny_dir, tmp_path):
    """peft 0.21 with the same adapter folder (written by megaopd's save_peft_adapter) gives the engine's
    log-probs."""
    peft = pytest.importorskip("peft")
    import transformers

    from megaopd.models.hf_io import save_peft_adapter

    adapter = _adapter(tiny_dir, 3)
    save_peft_adapter(
        str(tmp_path), adapter.items(), RANK, ALPHA, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    )
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tiny_dir), str(tmp_path))
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        lp = torch.log_softmax(model.eval()(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    runner.update_adapter(AdapterUpdate.of(adapter.items(), RANK, ALPHA, "v"))
    assert float((_logprobs(runner) - lp.double()).abs().max()) < 1e-4
