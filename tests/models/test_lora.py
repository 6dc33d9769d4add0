"""LoRA adapters on megatron's parallel linears (megaopd/models/lora.py) against float64 references.

- One ColumnParallelLinear (as linear_qkv) and one RowParallelLinear (as linear_proj), TP=1 and TP=2: output and
  gradients of A, B and the input equal the float64 formula W x + (alpha / r) B A x.
- A tiny Qwen2 GPTModel (GQA, QKV bias) with adapters on every linear at TP=1, TP=2 and PP=2: log-probs and the
  adapters' gradients (mapped to peft names by the one HF mapping) equal transformers in float64 with every
  projection W + (alpha / r) B A; with the adapters off the log-probs equal the base model's bit for bit; the
  merged export equals W + s B A; the adapter export loaded by peft onto the HF base gives the same log-probs.
One spawn of 2 gloo workers per group of cases.

    pytest tests/models/test_lora.py
"""

import pytest
import torch

from megaopd.parallel.launch import spawn
from tests.models import _lora_workers

SCALE = _lora_workers.LORA["alpha"] / _lora_workers.LORA["rank"]
LINEARS = ("linear_fc1", "linear_fc2", "linear_proj", "linear_qkv")


def _close(got, want, rel=1e-5):
    want = want.to(torch.float64)
    return float((got.to(torch.float64) - want).abs().max()) <= rel * max(1.0, float(want.abs().max()))


@pytest.fixture(scope="module")
def linear_results():
    gen = torch.Generator().manual_seed(0)
    r = _lora_workers.LORA["rank"]

    def case(out_f, in_f):
        t = {k: torch.randn(*s, generator=gen, dtype=torch.float64) for k, s in
             dict(W=(out_f, in_f), A=(r, in_f), B=(out_f, r), x=(5, 2, in_f), g=(5, 2, out_f)).items()}  # fmt: skip
        return t

    cases = dict(column=case(12, 8), row=case(8, 12))
    per_rank = spawn(_lora_workers.lora_linears, world_size=2, args=(cases,), timeout=600)
    return cases, per_rank


def _reference_linear(c):
    W, A, B, x, g = (c[k].clone().requires_grad_(k in "ABx") for k in ("W", "A", "B", "x", "g"))
    y = x @ W.T + SCALE * (x @ A.T) @ B.T
    (y * g).sum().backward()
    return dict(y=y.detach(), dA=A.grad, dB=B.grad, dx=x.grad)


@pytest.mark.slow
@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("kind", ("column", "row"))
def test_lora_linear_matches_float64_formula(linear_results, kind, tp):
    cases, per_rank = linear_results
    want = _reference_linear(cases[kind])
    for rank_results in per_rank:
        got = rank_results[(tp, kind)]
        for k in ("y", "dA", "dB", "dx"):
            assert _close(got[k], want[k]), (k, float((got[k].double() - want[k]).abs().max()))
        assert got["off_is_base"]
        assert got["frozen"]
        assert got["trainable"] == sorted(
            f"{'linear_qkv' if kind == 'column' else 'linear_proj'}.adapter.lora_{m}" for m in "AB"
        )


# ---------------------------------------------------------------------------------------------------------------
# A whole model.


def _hf_adapter(cfg):
    """peft-named adapter tensors for every projection, A shared by q/k/v and by gate/up (one fused linear)."""
    from megaopd.models.weights import adapter_hf_shapes

    gen = torch.Generator().manual_seed(1)
    shapes = adapter_hf_shapes(cfg, LINEARS, _lora_workers.LORA["rank"])
    out = {}
    for name, shape in shapes.items():
        shared = (
            name.replace(".k_proj.", ".q_proj.").replace(".v_proj.", ".q_proj.").replace(".up_proj.", ".gate_proj.")
        )
        if ".lora_A." in name and shared in out:
            out[name] = out[shared]
        else:
            out[name] = torch.randn(*shape, generator=gen) * 0.2
    return out


def _base_name(peft: str) -> str:
    from megaopd.models.weights import PEFT_PREFIX

    return peft[len(PEFT_PREFIX) :].replace(".lora_A.weight", ".weight").replace(".lora_B.weight", ".weight")


def _reference_model(hf_dir, ids, hf_adapter):
    """transformers in float64 with every projection W + s B A (A, B leaves): log-probs and the leaves' grads."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    params = dict(model.named_parameters())
    leaves = {}
    for name, t in hf_adapter.items():
        shared = (
            name.replace(".k_proj.", ".q_proj.").replace(".v_proj.", ".q_proj.").replace(".up_proj.", ".gate_proj.")
        )
        if ".lora_A." in name and shared in leaves:
            leaves[name] = leaves[shared]  # one tensor: its gradient sums over q, k, v (gate, up)
        else:
            leaves[name] = t.double().clone().requires_grad_(True)
    weights = {}
    for name in hf_adapter:
        if ".lora_A." in name:
            base = _base_name(name)
            weights[base] = params[base] + SCALE * leaves[name.replace(".lora_A.", ".lora_B.")] @ leaves[name]
    logits = torch.func.functional_call(model, weights, (ids,)).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    lp.sum().backward()
    return lp.detach(), {n: t.grad for n, t in leaves.items()}, {n: w.detach() for n, w in weights.items()}


@pytest.fixture(scope="module")
def model_results(tmp_path_factory):
    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.presets import make_hf_model

    hf_dir = str(tmp_path_factory.mktemp("lora") / "tiny-qwen2")
    make_hf_model("tiny-qwen2", hf_dir, seed=3)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(4))
    hf_adapter = _hf_adapter(read_hf_config(hf_dir))
    per_rank = spawn(_lora_workers.lora_model, world_size=2, args=(hf_dir, ids, hf_adapter), timeout=900)
    return hf_dir, ids, hf_adapter, per_rank


def _last_stage(per_rank, layout, key):
    found = [r[layout][key] for r in per_rank if r[layout][key] is not None]
    assert found, key
    return found


@pytest.mark.slow
@pytest.mark.parametrize("layout", _lora_workers.MODEL_LAYOUTS)
def test_lora_model_matches_transformers_float64(model_results, layout):
    hf_dir, ids, hf_adapter, per_rank = model_results
    lp_ref, grads_ref, merged_ref = _reference_model(hf_dir, ids, hf_adapter)
    for lp in _last_stage(per_rank, layout, "lora"):
        assert float((lp.double() - lp_ref).abs().max()) < 1e-4
    for r in per_rank:
        got = r[layout]
        assert set(got["grads"]) == set(grads_ref)
        for name, g in grads_ref.items():
            assert _close(got["grads"][name], g, rel=1e-4), (name, float((got["grads"][name].double() - g).abs().max()))
        # the exports: the adapters as set (bit-exact through the mapping), the merged weights W + s B A
        assert all(torch.equal(got["exported"][n], t) for n, t in hf_adapter.items())
        for name, w in merged_ref.items():
            assert _close(got["merged"][name], w, rel=1e-6), name
        assert got["adapted"] == 4 * 4 // layout[1]  # 4 linears per layer, 4 layers over pp stages
        assert got["trainable"] == got["adapter_params"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", _lora_workers.MODEL_LAYOUTS)
def test_adapters_off_is_the_base_model_exactly(model_results, layout):
    *_, per_rank = model_results
    assert _last_stage(per_rank, layout, "off_equals_base") and all(_last_stage(per_rank, layout, "off_equals_base"))
    # and the adapters do change the model (B is not zero here)
    for lp, base in zip(_last_stage(per_rank, layout, "lora"), _last_stage(per_rank, layout, "base")):
        assert float((lp - base).abs().max()) > 1e-3


@pytest.mark.slow
def test_peft_loads_the_exported_adapter(model_results, tmp_path):
    """The adapter folder megaopd writes, loaded by peft onto the HF base, gives megatron's log-probs with the
    adapters (float32, within the conversion bound of test_parity)."""
    peft = pytest.importorskip("peft")
    import transformers

    from megaopd.models.hf_io import save_peft_adapter

    hf_dir, ids, _, per_rank = model_results
    got = per_rank[0][(2, 1)]
    out = str(tmp_path / "adapter")
    lora = _lora_workers.LORA
    save_peft_adapter(out, got["exported"].items(), lora["rank"], lora["alpha"], LINEARS, base_model=hf_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    (megatron,) = _last_stage(per_rank, (2, 1), "lora")[:1]
    assert float((lp - megatron).abs().max()) < 1e-4


@pytest.mark.slow
def test_convert_writes_merged_model_and_peft_adapter(model_results, tmp_path):
    """tools/convert_megatron_to_hf.py on a LoRA checkpoint written at TP=2, read at TP=1: the merged HF model
    (transformers) and the peft adapter folder (peft onto the HF base) both give the checkpoint's log-probs."""
    import json

    import transformers

    from megaopd.models.hf_config import InputError
    from tools.convert_megatron_to_hf import main as convert_main

    hf_dir, ids, hf_adapter, _ = model_results
    ckpt = str(tmp_path / "ckpt")
    saved = spawn(_lora_workers.lora_checkpoint, world_size=2, args=(hf_dir, ids, hf_adapter, ckpt), timeout=600)[0]
    with open(f"{ckpt}/megaopd_checkpoint.json") as f:
        assert json.load(f)["lora"] == dict(
            enabled=True, rank=3, alpha=6.0, targets=["qkv", "proj", "fc1", "fc2"], dropout=0.0
        )

    def logprobs(model):
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]

    assert convert_main(["--ckpt", ckpt, "--out", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    assert float((logprobs(merged.eval()) - saved).abs().max()) < 1e-4

    assert convert_main(["--ckpt", ckpt, "--out", str(tmp_path / "adapter"), "--lora-export", "adapter"]) == 0
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (3, 6.0, hf_dir)
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert set(written) == set(hf_adapter) and all(torch.equal(written[n], t) for n, t in hf_adapter.items())
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    assert float((logprobs(adapted) - saved).abs().max()) < 1e-4
    # a checkpoint without adapters: one line, before any worker starts
    import shutil

    from megaopd.models.convert import validate_megatron_to_hf

    plain = shutil.copytree(ckpt, tmp_path / "plain")
    meta = json.loads((plain / "megaopd_checkpoint.json").read_text())
    del meta["lora"]
    (plain / "megaopd_checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(InputError, match="holds no LoRA adapters"):
        validate_megatron_to_hf(str(plain), str(tmp_path / "x"), lora_export="adapter")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ("adapter", "merged"))
def test_sync_to_embedded_engine_matches_actor(model_results, mode):
    """What a LoRA actor (TP=2) sends, loaded by the embedded engine: its adapters alone (update_adapter, merged
    there in float32) or its merged weights (update_weights): the engine's log-probs equal the actor's within the
    float32 parity bound, and the adapter sync moves a fraction of the bytes."""
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.engine.lora import AdapterUpdate
    from megaopd.engine.runner import ModelRunner

    hf_dir, ids, _, per_rank = model_results
    got = per_rank[0][(2, 1)]
    runner = ModelRunner(EmbeddedEngineConfig(hf_dir=hf_dir, max_batch_size=2, load_tokenizer=False))
    lora = _lora_workers.LORA
    if mode == "adapter":
        update = AdapterUpdate.of(got["exported"].items(), lora["rank"], lora["alpha"], "lora-v1")
        runner.update_adapter(update)
        sent = update.nbytes()
    else:
        runner.update_weights(got["merged"].items(), weight_version="merged-v1")
        sent = sum(t.numel() * t.element_size() for t in got["merged"].values())
    (actor,) = _last_stage(per_rank, (2, 1), "lora")[:1]
    for row in range(ids.shape[0]):
        engine = torch.tensor(runner.prompt_logprobs(ids[row].tolist())[1:])
        assert float((engine - actor[row]).abs().max()) < 1e-4
    full = sum(t.numel() * t.element_size() for t in got["merged"].values())
    # tiny-qwen2 (hidden 96, 4 layers, vocab 300), rank 3, peft names: 18048 of 378592 numbers, 4.8% of a full sync
    assert sent == full if mode == "merged" else sent * 378592 == full * 18048
