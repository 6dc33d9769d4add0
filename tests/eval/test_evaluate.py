"""evaluate(): scoring arithmetic with scripted responses, table format, end-to-end with a tiny model."""

import json
import os

import pytest

from megaopd.eval import PROMPT_SUFFIX, EvalConfig, EvalModel, any_at_k, evaluate, mean_at_k, prompt_text
from megaopd.eval.benchmarks import Benchmark, Problem, write_benchmark_file
from megaopd.metrics import RepetitionConfig
from tests.eval.scripted_engine import ScriptedEngine


def test_mean_and_any_at_k_by_hand():
    c = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert mean_at_k(c) == pytest.approx((0.5 + 0 + 1) / 3)
    assert any_at_k(c) == pytest.approx(2 / 3)
    assert mean_at_k([[1], [0], [1], [1]]) == 0.75  # pass@1
    assert mean_at_k([]) == 0.0


@pytest.fixture(scope="module")
def tok(tiny_hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_hf_dir)


def test_prompt_template(tok):
    text = prompt_text(tok, "  What is 1+1? ")
    assert text == f"<|im_start|>user\nWhat is 1+1?\n{PROMPT_SUFFIX}<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_text(tok, "What is 1+1?", use_chat_template=False) == f"What is 1+1?\n{PROMPT_SUFFIX}"


def test_scripted_avg_at_k_rates_and_files(tok, tmp_path):
    half = Benchmark("half", [Problem("h1", "p", "\\frac{1}{2}"), Problem("h2", "q", "3")], samples=1)
    many = Benchmark("many", [Problem("m1", "p", "10"), Problem("m2", "q", "7")], samples=4)
    loop = "\\boxed{10} " + "again " * 100  # long and compressible: repetitive with L = 200
    texts = [
        "so \\boxed{0.5}",
        "no box: 3",  # half: 1, 0 -> pass@1 = 0.5
        "\\boxed{10}",
        "\\boxed{10.0}",
        "\\boxed{11}",
        loop,  # m1: 1, 1, 0, 1
        "\\boxed{7",
        "\\boxed{}",
        "\\boxed{7}",
        "\\boxed{ 7 }",  # m2: 0, 0, 1, 1
    ]
    reasons = ["stop", "length", "stop", "stop", "stop", "length", "length", "stop", "stop", "stop"]
    eng = ScriptedEngine(tok, texts, reasons)
    cfg = EvalConfig(batch_size=4, repetition=RepetitionConfig(window_chars=200), max_new_tokens=32)
    res = evaluate(EvalModel(eng, tok, "tiny"), [half, many], cfg, out_dir=str(tmp_path))
    h, m = res.benchmarks
    assert (h.metric, h.accuracy, h.truncation_rate, h.repetition_rate) == ("pass@1", 0.5, 0.5, 0.0)
    assert (m.metric, m.accuracy, m.pass_at_k) == ("avg@4", pytest.approx((0.75 + 0.5) / 2), 1.0)
    assert m.truncation_rate == pytest.approx(2 / 8) and m.repetition_rate == pytest.approx(1 / 8)
    assert res.average == pytest.approx((0.5 + 0.625) / 2)
    # batch_size counts sequences, one per (problem, sample) unit u = i * k + j, whose index is first + position.
    assert [(n, p.n, p.temperature, p.seed, first) for n, p, first in eng.calls] == [
        (2, 1, 0.6, 0, 0),
        (4, 1, 0.6, 0, 0),
        (4, 1, 0.6, 0, 4),
    ]
    assert eng.calls[0][1].stop_token_ids == [tok.eos_token_id]
    metrics = res.to_metrics("val")
    assert metrics["val/accuracy"] == pytest.approx(0.5625)
    assert metrics["val/truncation_rate"] == pytest.approx(3 / 10)
    assert metrics["val/many/accuracy"] == pytest.approx(0.625)

    gens = [json.loads(row) for row in open(tmp_path / "generations.jsonl")]
    assert len(gens) == 10
    assert [g["correct"] for g in gens] == [True, False, True, True, False, True, False, False, True, True]
    assert gens[0]["extracted"] == "0.5" and gens[1]["extracted"] is None and gens[5]["repetitive"]
    saved = json.load(open(tmp_path / "results.json"))
    assert saved["columns"] == ["half", "many", "Avg"] and saved["average"] == pytest.approx(0.5625)
    assert saved["config"]["temperature"] == 0.6
    md = (tmp_path / "results.md").read_text()
    assert md == res.markdown()
    lines = md.splitlines()
    assert lines[0] == "| Model | half | many | Avg |"
    assert lines[1] == "|---|---:|---:|---:|"
    assert lines[2] == "| tiny | 50.0 | 62.5 | 56.2 |"
    assert "| metric | pass@1 | avg@4 | |" in lines
    assert "| truncation (%) | 50.0 | 25.0 | 30.0 |" in lines


def test_paper_column_order(tok, tmp_path):
    for name in ("aime25", "minerva", "math500"):
        write_benchmark_file([{"id": "1", "problem": "p", "answer": "1"}], str(tmp_path / f"{name}.jsonl"))
    eng = ScriptedEngine(tok, ["\\boxed{1}"] * 6)
    res = evaluate(
        EvalModel(eng, tok),
        ["aime25", "minerva", "math500"],
        EvalConfig(samples=2, max_new_tokens=8),
        data_dir=str(tmp_path),
    )
    assert res.markdown().splitlines()[0] == "| Model | MATH-500 | Minerva | AIME25 | Avg |"
    assert [b.metric for b in res.benchmarks] == ["avg@2"] * 3


def test_end_to_end_tiny_model(tiny_hf_dir, tiny_bench, tmp_path):
    from transformers import AutoTokenizer

    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.rollout.embedded import EmbeddedEngine

    tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    eng = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_hf_dir, max_batch_size=4))
    cfg = EvalConfig(samples=2, max_new_tokens=12, batch_size=4, limit=2)
    res = evaluate(EvalModel(eng, tok), [tiny_bench], cfg, out_dir=str(tmp_path))
    # Seeded per (problem, sample): one prompt per call gives the same generations as two per call.
    evaluate(
        EvalModel(eng, tok),
        [tiny_bench],
        EvalConfig(samples=2, max_new_tokens=12, batch_size=2, limit=2),
        out_dir=str(tmp_path / "b1"),
    )
    assert (tmp_path / "generations.jsonl").read_text() == (tmp_path / "b1" / "generations.jsonl").read_text()
    (b,) = res.benchmarks
    assert (b.name, b.n_problems, b.samples, b.metric) == ("tiny", 2, 2, "avg@2")
    assert 0.0 <= b.accuracy <= 1.0 and 0.0 <= b.truncation_rate <= 1.0
    assert 0 < b.response_tokens_mean <= 12
    gens = [json.loads(row) for row in open(tmp_path / "generations.jsonl")]
    assert len(gens) == 4 and {g["id"] for g in gens} == {"a", "b"}
    assert all(isinstance(g["correct"], bool) for g in gens)


def test_cli_end_to_end(tiny_hf_dir, tiny_bench, tmp_path, capsys):
    from megaopd.cli import main as cli_main

    out = tmp_path / "out"
    rc = cli_main(
        [
            "eval",
            "--ckpt",
            tiny_hf_dir,
            "--benchmarks",
            tiny_bench,
            "--max-new-tokens",
            "8",
            "--samples",
            "1",
            "--out",
            str(out),
            "--label",
            "tiny",
        ]
    )
    assert rc == 0
    assert "| Model | tiny | Avg |" in capsys.readouterr().out
    assert all(os.path.exists(out / f) for f in ("results.md", "results.json", "generations.jsonl"))
    assert cli_main(["eval", "--ckpt", tiny_hf_dir, "--benchmarks", "gsm8k"]) == 2
    assert cli_main(["eval", "--ckpt", str(tmp_path)]) == 2  # neither HF nor Megatron


def test_prompt_fn_override_and_tiny_tokenizer_matches_training_render(tok):
    seen = []

    class Recorder(ScriptedEngine):
        def generate(self, prompts, params, first_prompt_index=0):
            seen.extend(prompts)
            return super().generate(prompts, params, first_prompt_index)

    b = Benchmark("x", [Problem("1", "What is 1+1?", "2")])
    evaluate(
        EvalModel(Recorder(tok, ["\\boxed{2}"]), tok, prompt_fn=lambda p: [7, 7, 7]), [b], EvalConfig(max_new_tokens=4)
    )
    assert seen == [[7, 7, 7]]
    # Default rendering = the training data's (megaopd.data.templates, student chat template).
    from megaopd.data.config import DataConfig
    from megaopd.data.templates import render_and_encode

    seen.clear()
    evaluate(EvalModel(Recorder(tok, ["\\boxed{2}"]), tok), [b], EvalConfig(max_new_tokens=4))
    assert seen == [render_and_encode("What is 1+1?", DataConfig(), tok)[1]]


def test_cli_rejects_unknown_folder(tiny_bench, tmp_path, capsys):
    from megaopd.cli import main as cli_main

    folder = tmp_path / "not_a_model"
    folder.mkdir()
    assert cli_main(["eval", "--ckpt", str(folder), "--benchmarks", tiny_bench]) == 2
    assert "neither an HF folder" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_megatron_checkpoint(tiny_hf_dir, tiny_bench, tmp_path, capsys):
    """A megaopd Megatron checkpoint is exported to HF (megaopd.models.convert) and evaluated; it must give
    the same generations as the HF folder it came from (the export is bit-exact, sampling is seeded)."""
    from megaopd.cli import main as cli_main
    from megaopd.models.convert import hf_to_megatron

    ckpt = tmp_path / "megatron"
    hf_to_megatron(tiny_hf_dir, str(ckpt))
    args = ["--benchmarks", tiny_bench, "--max-new-tokens", "8", "--samples", "2"]
    assert cli_main(["eval", "--ckpt", str(ckpt), "--out", str(tmp_path / "m"), *args]) == 0
    assert cli_main(["eval", "--ckpt", tiny_hf_dir, "--out", str(tmp_path / "h"), *args]) == 0
    assert os.listdir(tmp_path / "m") and not [d for d in os.listdir(tmp_path / "m") if d.startswith("hf_export_")]
    assert (tmp_path / "m" / "generations.jsonl").read_text() == (tmp_path / "h" / "generations.jsonl").read_text()


def test_answers_found_warning_and_rescore_with_another_extraction(tok, tmp_path):
    """A model that never boxes reads 0.0 under boxed, and the table says why; the same folder evaluated
    again with extract=number re-scores the stored responses without generating any."""
    from megaopd.metrics import RewardConfig

    bench = Benchmark("arith", [Problem("a", "p", "7"), Problem("b", "q", "42")], samples=2)
    texts = ["3 + 4 = 7 apples.", "I do not know.", "The answer is 42.", "The answer is 41."]
    eng = ScriptedEngine(tok, texts)
    res = evaluate(EvalModel(eng, tok, "smol"), [bench], EvalConfig(max_new_tokens=16), out_dir=str(tmp_path))
    assert (res.benchmarks[0].answers_found, res.responses, res.average) == (0, 4, 0.0)
    assert res.answers_line() == "answers found: 0 of 4 (extract=boxed)"
    assert res.answers_warning("--extract ").startswith("0 of 4 responses had a \\boxed{} answer")
    assert "| answers found (extract=boxed) | 0 of 4 | 0 of 4 |" in res.markdown().splitlines()
    metrics = res.to_metrics("val")
    assert (metrics["val/answers_found"], metrics["val/answers_found_count"]) == (0.0, 0.0)

    idle = ScriptedEngine(tok, [])  # nothing to generate: a call would pop from an empty script
    num = evaluate(
        EvalModel(idle, tok, "smol"),
        [bench],
        EvalConfig(max_new_tokens=16, reward=RewardConfig(extract="number")),
        out_dir=str(tmp_path),
    )
    assert idle.calls == []
    b = num.benchmarks[0]
    assert (b.answers_found, b.accuracy, b.pass_at_k) == (3, 0.5, 1.0)
    assert num.answers_line() == "answers found: 3 of 4 (extract=number)" and num.answers_warning("--extract ") is None
    assert num.to_metrics("val")["val/answers_found"] == 0.75
    saved = json.load(open(tmp_path / "results.json"))
    assert (saved["extract"], saved["answers_found"], saved["responses"]) == ("number", 3, 4)
    # The store keeps both verdicts; the later one wins when read back (a third run re-scores nothing).
    gens = [json.loads(row) for row in open(tmp_path / "generations.jsonl")]
    assert [g["extract"] for g in gens] == ["boxed"] * 4 + ["number"] * 4
    assert [g["extracted"] for g in gens[4:]] == ["7", None, "42", "41"]
    number = EvalConfig(reward=RewardConfig(extract="number"), max_new_tokens=16)
    again = evaluate(EvalModel(ScriptedEngine(tok, []), tok), [bench], number, out_dir=str(tmp_path))
    assert again.benchmarks[0].accuracy == b.accuracy and len(open(tmp_path / "generations.jsonl").readlines()) == 8


def test_records_written_before_the_extraction_field_read_as_boxed():
    from megaopd.eval.generations import GenerationRecord

    old = {
        "benchmark": "b",
        "index": 0,
        "id": "x",
        "sample": 0,
        "samples": 1,
        "problem": "p",
        "answer": "1",
        "response": "\\boxed{1}",
        "extracted": "1",
        "correct": True,
        "finish_reason": "stop",
        "response_tokens": 3,
        "repetitive": False,
    }
    assert GenerationRecord.from_dict(old).extract == "boxed"
    with pytest.raises(ValueError, match="record lacks \\['correct'\\]"):
        GenerationRecord.from_dict({k: v for k, v in old.items() if k != "correct"})


def test_cli_extract_flag_reports_answers_found(tiny_hf_dir, tiny_bench, tmp_path, capsys):
    from megaopd.cli import main as cli_main

    out = tmp_path / "out"
    args = [
        "eval",
        "--ckpt",
        tiny_hf_dir,
        "--benchmarks",
        tiny_bench,
        "--max-new-tokens",
        "8",
        "--samples",
        "1",
        "--out",
        str(out),
    ]
    assert cli_main(args) == 0
    got = capsys.readouterr()
    # The random tiny model never closes a \boxed{}: 0 found, and one warning line naming the fix.
    assert "answers found: 0 of 3 (extract=boxed)" in got.out
    warning = [line for line in got.err.splitlines() if "megaopd eval: warning:" in line]
    assert len(warning) == 1 and "0 of 3 responses had a \\boxed{} answer" in warning[0]
    assert "--extract number" in warning[0]
    assert cli_main(args + ["--extract", "any"]) == 0
    assert "(extract=any)" in capsys.readouterr().out
    assert json.load(open(out / "results.json"))["extract"] == "any"
    with pytest.raises(SystemExit):
        cli_main(args + ["--extract", "last"])
    assert "invalid choice: 'last'" in capsys.readouterr().err
