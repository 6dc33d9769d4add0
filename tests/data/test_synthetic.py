"""The tiny synthetic data: deterministic, every answer verified by math-verify, files reproducible."""

import json
import os
import random
import subprocess
import sys

from math_verify import parse, verify

from megaopd.data.synthetic import generate_splits, make_problem
from tests.data.conftest import ROOT, TINY_DATA


def test_generator_is_deterministic_and_answers_verify():
    sizes = [("sft", 60), ("opd", 30), ("val", 10)]
    a, b = generate_splits(sizes, seed=3), generate_splits(sizes, seed=3)
    assert a == b and a != generate_splits(sizes, seed=4)
    problems = [r["problem"] for rows in a.values() for r in rows]
    assert len(set(problems)) == len(problems)  # no problem in two splits
    kinds = set()
    for rows in a.values():
        for r in rows:
            kinds.add(r["problem_type"])
            gold = parse("\\boxed{" + r["answer"] + "}")
            got = [bool(verify(gold, parse(g))) for g in r["generations"]]
            assert got == r["correctness_math_verify"] and sum(got) == 1 == r["correctness_count"]
            assert all(g.startswith("<think>\n") and "</think>\nThe answer is \\boxed{" in g for g in r["generations"])
    assert kinds == {"Algebra", "Arithmetic"}
    assert all(len(r["generations"]) == 1 for r in a["val"])


def test_every_kind_of_problem_is_consistent():
    rng = random.Random(0)
    for _ in range(400):
        p = make_problem(rng)
        if p is None:
            continue
        assert p.steps[-1].endswith(str(p.answer))
        if p.wrong_steps is not None:
            assert p.wrong_answer != p.answer or p.wrong_steps == p.steps


def test_committed_tiny_data_has_verified_answers():
    for name, n in (("sft", 4000), ("opd", 2000), ("val", 200)):
        rows = [json.loads(x) for x in open(os.path.join(TINY_DATA, f"{name}.jsonl"))]
        assert len(rows) == n
        for r in rows[::25]:  # a sample: the full set is verified by --check's rebuild
            gold = parse("\\boxed{" + r["answer"] + "}")
            assert [bool(verify(gold, parse(g))) for g in r["generations"]] == r["correctness_math_verify"]


def test_build_tiny_data_check_passes():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "build_tiny_data.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr + out.stdout


def test_check_mode_detects_a_changed_file(tmp_path):
    sys.path.insert(0, ROOT)
    import tools.build_tiny_data as build

    args = ["--data-dir", str(tmp_path / "d"), "--tokenizer-dir", str(tmp_path / "t"), "--sizes", "sft=20,val=5"]
    assert build.main(args) == 0
    assert build.main(args + ["--check"]) == 0
    with open(tmp_path / "d" / "val.jsonl", "a") as f:
        f.write("\n")
    assert build.main(args + ["--check"]) == 1
