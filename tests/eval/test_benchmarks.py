"""Benchmark file format, registry order and conversion of the public releases' schemas."""

import pytest

from megaopd.eval import BENCHMARKS, load_benchmark_file, resolve_benchmarks
from megaopd.eval.benchmarks import convert_rows, write_benchmark_file


def test_registry_defaults_match_paper():
    assert list(BENCHMARKS) == ["math500", "minerva", "olympiadbench", "amc", "aime24", "aime25"]
    assert {n: s.samples for n, s in BENCHMARKS.items()} == {
        "math500": 1,
        "minerva": 1,
        "olympiadbench": 1,
        "amc": 32,
        "aime24": 32,
        "aime25": 32,
    }


def test_load_and_errors(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"id": "1", "problem": "p", "answer": "2"}\n\n{"problem": "q", "answer": 3}\n')
    b = load_benchmark_file(str(p))
    assert b.name == "x" and b.samples == 1 and b.metric_name == "pass@1"
    assert [(q.id, q.answer) for q in b.problems] == [("1", "2"), ("x-2", "3")]
    p.write_text('{"id": "1", "problem": "p"}\n')
    with pytest.raises(ValueError, match=r'x.jsonl:1: missing or empty "answer"'):
        load_benchmark_file(str(p))
    p.write_text('{"id": "1", "problem": "p", "answer": "1"}\n{"id": "1", "problem": "p", "answer": "1"}\n')
    with pytest.raises(ValueError, match="duplicate id"):
        load_benchmark_file(str(p))
    p.write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        load_benchmark_file(str(p))
    with pytest.raises(FileNotFoundError, match="prepare_benchmarks"):
        load_benchmark_file(str(tmp_path / "missing.jsonl"))


def test_resolve_order_and_samples(tmp_path):
    for name in ("aime24", "math500"):
        write_benchmark_file([{"id": "1", "problem": "p", "answer": "1"}], str(tmp_path / f"{name}.jsonl"))
    extra = tmp_path / "mine.jsonl"
    write_benchmark_file([{"id": "1", "problem": "p", "answer": "1"}], str(extra))
    got = resolve_benchmarks([str(extra), "aime24", "math500"], str(tmp_path))
    assert [(b.name, b.samples, b.metric_name) for b in got] == [
        ("math500", 1, "pass@1"),
        ("aime24", 32, "avg@32"),
        ("mine", 1, "pass@1"),
    ]
    assert [b.samples for b in resolve_benchmarks(["aime24", "math500"], str(tmp_path), samples=4)] == [4, 4]
    with pytest.raises(ValueError, match="unknown benchmark 'gsm8k'"):
        resolve_benchmarks(["gsm8k"], str(tmp_path))


def test_convert_release_schemas():
    # MATH-500: problem, solution, answer, subject, level, unique_id
    math500 = [
        {
            "problem": "P",
            "solution": "... \\boxed{\\frac{1}{2}}",
            "answer": "\\frac{1}{2}",
            "subject": "Algebra",
            "level": 3,
            "unique_id": "test/algebra/1.json",
        }
    ]
    assert convert_rows(math500, "math500") == [
        {"id": "math500-test/algebra/1.json", "problem": "P", "answer": "\\frac{1}{2}"}
    ]
    # Minerva (Qwen2.5-Math release): problem + solution with a box, no answer column
    minerva = [{"problem": "Q", "solution": "so \\boxed{3 \\times 10^{8}} m/s", "idx": 0}]
    assert convert_rows(minerva, "minerva")[0]["answer"] == "3 \\times 10^{8}"
    # OlympiadBench: question + final_answer as a list of $...$ strings
    olymp = [{"id": 7, "question": "Q", "final_answer": ["$\\sqrt{2}$", "$3$"], "solution": ["..."]}]
    assert convert_rows(olymp, "olympiadbench") == [{"id": "olympiadbench-7", "problem": "Q", "answer": "\\sqrt{2}, 3"}]
    # AMC (AI-MO release): answer stored as a float
    amc = [{"id": 0, "problem": "Q", "answer": 12.0, "url": "u"}]
    assert convert_rows(amc, "amc")[0]["answer"] == "12"
    # AIME releases with capitalized columns; no id -> row index
    aime = [{"Problem": "Q", "Answer": 204}, {"Problem": "R", "Answer": "033"}]
    assert [r["answer"] for r in convert_rows(aime, "aime24")] == ["204", "033"]
    assert [r["id"] for r in convert_rows(aime, "aime24")] == ["aime24-0", "aime24-1"]


def test_convert_errors():
    with pytest.raises(ValueError, match=r"no problem column .*found text, label"):
        convert_rows([{"text": "Q", "label": 1}], "x")
    with pytest.raises(ValueError, match=r"no answer column .*found question"):
        convert_rows([{"question": "Q"}], "x")
    with pytest.raises(ValueError, match="row 1 .* has no answer"):
        convert_rows([{"question": "Q", "solution": "\\boxed{1}"}, {"question": "R", "solution": "no box"}], "x")
    with pytest.raises(ValueError, match="column 'ans' not in"):
        convert_rows([{"question": "Q", "a": 1}], "x", answer_column="ans")
    assert convert_rows([{"question": "Q", "a": "1", "answer": "9"}], "x", answer_column="a")[0]["answer"] == "1"
