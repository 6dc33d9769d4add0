"""tools/prepare_benchmarks.py on local files in the releases' layouts."""

import importlib.util
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from megaopd.eval import load_benchmark_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tools/ is scripts, not a package: load the file by path.
_spec = importlib.util.spec_from_file_location(
    "prepare_benchmarks", os.path.join(ROOT, "tools", "prepare_benchmarks.py")
)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
main = _mod.main


def test_prepare_jsonl_and_parquet(tmp_path):
    src = tmp_path / "math500.jsonl"
    src.write_text(json.dumps({"problem": "P", "solution": "\\boxed{5}", "answer": "5", "unique_id": "u1"}) + "\n")
    olymp = tmp_path / "olymp.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": 1, "question": "Q", "final_answer": ["$\\frac{1}{2}$"]}]), olymp)
    out = tmp_path / "bench"
    assert main(["--out", str(out), f"math500={src}", f"olympiadbench={olymp}"]) == 0
    assert load_benchmark_file(str(out / "olympiadbench.jsonl")).problems[0].answer == "\\frac{1}{2}"
    assert load_benchmark_file(str(out / "math500.jsonl")).problems[0].id == "math500-u1"


def test_prepare_missing_column_message(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"question": "Q", "label": 3}) + "\n")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "prepare_benchmarks.py"), "--out", str(tmp_path), f"amc={src}"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "no answer column" in r.stderr and "found question, label" in r.stderr
