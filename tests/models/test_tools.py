"""tools/convert_hf_to_megatron.py, tools/convert_megatron_to_hf.py and `megaopd logprobs`, end to end as
subprocesses (slow), and their input checks one by one (fast: they fail before megatron is imported).

    pytest tests/models/test_tools.py -x             # everything (~2-3 min on 2 cores)
    pytest tests/models/test_tools.py -x -m "not slow"
"""

import filecmp
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TO_MEGATRON = os.path.join(ROOT, "tools", "convert_hf_to_megatron.py")
TO_HF = os.path.join(ROOT, "tools", "convert_megatron_to_hf.py")
LOGPROBS = [sys.executable, "-m", "megaopd.cli", "logprobs"]


def _run(cmd, timeout=600):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _ok(cmd):
    p = _run(cmd)
    assert p.returncode == 0, f"{cmd}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-4000:]}"
    return p


def _write_inputs(path, ids):
    lengths = [9, 5, 2, 1, 7]  # ragged, including a single token (no log-probs)
    rows = [ids[i % len(ids), :n].tolist() for i, n in enumerate(lengths)]
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"input_ids": r}) + "\n")
    return rows


def _hf_logprobs(hf_dir, rows):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    for r in rows:
        x = torch.tensor([r])
        with torch.no_grad():
            lp = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
        out.append(lp.gather(-1, x[0, 1:, None])[:, 0])
    return out


def _check_logprobs(out_path, expected):
    with open(out_path) as f:
        got = [json.loads(line)["logprobs"] for line in f]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert len(g) == len(e)
        if len(e):
            assert (torch.tensor(g) - e).abs().max() < 1e-4


@pytest.mark.slow
def test_roundtrip_tp2_pp2_bit_exact_and_logprobs_at_tp1(hf_models, tmp_path):
    """Tied Qwen2 (the hard case: the last stage's embedding copy) through both tools, then scored
    from the TP=2 PP=2 checkpoint at TP=1 PP=1."""
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast

    m = hf_models["tiny-qwen2-tied"]
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    _ok([sys.executable, TO_MEGATRON, "--hf-dir", m["hf_dir"], "--out", ckpt, "--tp", "2", "--pp", "2"])
    meta = json.load(open(os.path.join(ckpt, "megaopd_checkpoint.json")))
    assert (meta["tp"], meta["pp"], meta["dtype"]) == (2, 2, "float32")
    _ok([sys.executable, TO_HF, "--ckpt", ckpt, "--out", back])

    src, dst = (
        load_file(os.path.join(m["hf_dir"], "model.safetensors")),
        load_file(os.path.join(back, "model.safetensors")),
    )
    assert src.keys() == dst.keys()
    for n in src:
        assert src[n].dtype == dst[n].dtype and torch.equal(src[n], dst[n]), n
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert filecmp.cmp(os.path.join(m["hf_dir"], name), os.path.join(back, name), shallow=False), name
    tok = PreTrainedTokenizerFast.from_pretrained(back)
    assert tok("t1 t5 t7").input_ids == [1, 5, 7]

    inp, out = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    rows = _write_inputs(inp, m["ids"])
    expected = _hf_logprobs(back, rows)  # transformers loads the exported directory
    _ok(LOGPROBS + ["--ckpt", ckpt, "--tp", "1", "--pp", "1", "--input", inp, "--output", out])
    _check_logprobs(out, expected)


@pytest.mark.slow
def test_roundtrip_untied_qwen2_tp2(hf_models, tmp_path):
    from safetensors.torch import load_file

    m = hf_models["tiny-qwen2"]
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    _ok([sys.executable, TO_MEGATRON, "--hf-dir", m["hf_dir"], "--out", ckpt, "--tp", "2", "--pp", "1"])
    _ok([sys.executable, TO_HF, "--ckpt", ckpt, "--out", back])
    src, dst = (
        load_file(os.path.join(m["hf_dir"], "model.safetensors")),
        load_file(os.path.join(back, "model.safetensors")),
    )
    assert src.keys() == dst.keys() and "lm_head.weight" in dst
    assert all(torch.equal(src[n], dst[n]) for n in src)


@pytest.mark.slow
@pytest.mark.parametrize("name,layout", [("tiny-qwen3", ("2", "2", "1")), ("tiny-qwen3-moe", ("1", "2", "2"))])
def test_roundtrip_qwen3_bit_exact(hf_models, tmp_path, name, layout):
    """Qwen3 written at TP=2 PP=2 and Qwen3-MoE with its experts split at EP=2 (4 ranks), exported at
    TP=1 PP=1 EP=1: every tensor bit-exact; the MoE checkpoint then scores like transformers."""
    from safetensors.torch import load_file

    m = hf_models[name]
    tp, pp, ep = layout
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    _ok([sys.executable, TO_MEGATRON, "--hf-dir", m["hf_dir"], "--out", ckpt, "--tp", tp, "--pp", pp, "--ep", ep])
    _ok([sys.executable, TO_HF, "--ckpt", ckpt, "--out", back])
    src, dst = (
        load_file(os.path.join(m["hf_dir"], "model.safetensors")),
        load_file(os.path.join(back, "model.safetensors")),
    )
    assert src.keys() == dst.keys()
    assert all(src[n].dtype == dst[n].dtype and torch.equal(src[n], dst[n]) for n in src)
    if name == "tiny-qwen3-moe":
        inp, out = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
        rows = _write_inputs(inp, m["ids"])
        _ok(LOGPROBS + ["--ckpt", ckpt, "--tp", "2", "--input", inp, "--output", out])
        _check_logprobs(out, _hf_logprobs(m["hf_dir"], rows))


@pytest.mark.slow
def test_logprobs_from_hf_dir_at_tp2(hf_models, tmp_path):
    """--ckpt given an HF directory (converted on the fly); Llama's vocab 100 makes TP rank 1's shard all padding."""
    m = hf_models["tiny-llama"]
    inp, out = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    rows = _write_inputs(inp, m["ids"])
    _ok(LOGPROBS + ["--ckpt", m["hf_dir"], "--tp", "2", "--input", inp, "--output", out, "--micro-batch-size", "2"])
    _check_logprobs(out, _hf_logprobs(m["hf_dir"], rows))


# ------------------------------------------------------------------------------------------------
# Input checks: one clear line, exit code 2, before any expensive start-up.


def _load_tool(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def _expect_error(main, argv, match, capsys):
    with pytest.raises(SystemExit) as e:  # argparse errors exit; InputErrors return 2
        raise SystemExit(main(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert match in lines[0], lines[0]


@pytest.fixture(scope="module")
def bad_dirs(hf_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    good = hf_models["tiny-qwen2"]["hf_dir"]
    made = {}
    for name, patch in {
        "gpt2": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
        "more_layers": {"num_hidden_layers": 6},
    }.items():
        d = root / name
        shutil.copytree(good, d)
        raw = json.load(open(d / "config.json"))
        raw.update(patch)
        (d / "config.json").write_text(json.dumps(raw))
        made[name] = str(d)
    pickle_only = root / "pickle_only"
    pickle_only.mkdir()
    shutil.copy(os.path.join(good, "config.json"), pickle_only / "config.json")
    (pickle_only / "pytorch_model.bin").write_bytes(b"not read")
    made["pickle_only"] = str(pickle_only)
    (root / "empty_cfg").mkdir()
    made["no_config"] = str(root / "empty_cfg")
    nonempty = root / "nonempty"
    nonempty.mkdir()
    (nonempty / "x").write_text("x")
    made["nonempty"] = str(nonempty)
    return made


@pytest.mark.parametrize(
    "case,args,match",
    [
        ("missing_dir", ["--hf-dir", "/nonexistent/model", "--tp", "1"], "does not exist"),
        ("no_config", ["--hf-dir", "{no_config}"], "no HF config"),
        ("unsupported", ["--hf-dir", "{gpt2}"], "unsupported architecture 'GPT2LMHeadModel'"),
        ("heads", ["--hf-dir", "{good}", "--tp", "4"], "tp=4 does not divide num_attention_heads=6"),
        ("groups", ["--hf-dir", "{good}", "--tp", "3"], "tp=3 does not divide the 2 key/value heads"),
        ("layers", ["--hf-dir", "{good}", "--pp", "3"], "pp=3 does not divide num_hidden_layers=4"),
        ("pickle", ["--hf-dir", "{pickle_only}"], "pickle weights"),
        ("mismatch", ["--hf-dir", "{more_layers}"], "safetensors lack"),
        ("out_not_empty", ["--hf-dir", "{good}", "--out", "{nonempty}"], "not empty"),
    ],
)
def test_convert_hf_to_megatron_input_errors(case, args, match, bad_dirs, hf_models, tmp_path, capsys):
    fill = {**bad_dirs, "good": hf_models["tiny-qwen2"]["hf_dir"]}
    argv = [a.format(**fill) for a in args]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    _expect_error(_load_tool(TO_MEGATRON), argv, match, capsys)
    assert not os.path.exists(tmp_path / "out")


def test_convert_megatron_to_hf_input_errors(hf_models, tmp_path, capsys):
    main = _load_tool(TO_HF)
    _expect_error(main, ["--ckpt", "/nonexistent/ckpt", "--out", str(tmp_path / "o")], "does not exist", capsys)
    _expect_error(
        main,
        ["--ckpt", hf_models["tiny-qwen2"]["hf_dir"], "--out", str(tmp_path / "o")],
        "not a megaopd Megatron checkpoint",
        capsys,
    )
    _expect_error(main, ["--out", str(tmp_path / "o")], "the following arguments are required: --ckpt", capsys)


def test_logprobs_input_errors(hf_models, tmp_path, capsys):
    from megaopd.scoring.cli import main

    hf = hf_models["tiny-qwen2"]["hf_dir"]
    out = str(tmp_path / "out.jsonl")
    cases = {
        "missing_input": ("", "input file"),
        "not_json": ('{"input_ids": [1, 2]}\n{oops\n', "in.jsonl:2: not JSON"),
        "no_ids": ('{"ids": [1]}\n', "in.jsonl:1: expected"),
        "empty_ids": ('{"input_ids": []}\n', "in.jsonl:1: expected"),
        "out_of_vocab": ('{"input_ids": [1, 300]}\n', "token id 300 outside the vocabulary [0, 300)"),
    }
    for case, (content, match) in cases.items():
        inp = tmp_path / f"{case}" / "in.jsonl"
        inp.parent.mkdir()
        if content:
            inp.write_text(content)
        _expect_error(main, ["--ckpt", hf, "--input", str(inp), "--output", out], match, capsys)
    good = tmp_path / "good.jsonl"
    good.write_text('{"input_ids": [1, 2, 3]}\n')
    _expect_error(main, ["--ckpt", "/nonexistent", "--input", str(good), "--output", out], "does not exist", capsys)
    _expect_error(
        main, ["--ckpt", hf, "--tp", "4", "--input", str(good), "--output", out], "tp=4 does not divide", capsys
    )
    _expect_error(
        main,
        ["--ckpt", str(tmp_path), "--input", str(good), "--output", out],
        "neither a megaopd Megatron checkpoint nor an HF directory",
        capsys,
    )
    assert not os.path.exists(out)


@pytest.mark.slow
def test_errors_exit_fast_as_real_processes(hf_models, tmp_path):
    """The real entry points: exit code 2, one stderr line, no megatron start-up (a few seconds at most)."""
    hf = hf_models["tiny-qwen2"]["hf_dir"]
    for cmd in (
        [sys.executable, TO_MEGATRON, "--hf-dir", hf, "--out", str(tmp_path / "o"), "--tp", "4"],
        [sys.executable, TO_HF, "--ckpt", hf, "--out", str(tmp_path / "o")],
        LOGPROBS + ["--ckpt", hf, "--input", str(tmp_path / "missing.jsonl"), "--output", "x"],
    ):
        t0 = time.monotonic()
        p = _run(cmd, timeout=120)
        assert p.returncode == 2, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert time.monotonic() - t0 < 30  # no megatron import (~10 s alone, more under load)
