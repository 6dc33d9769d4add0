"""slurm/eval_7b.sh (DRY_RUN=1: the commands each checkpoint gets) and the combined table
(megaopd.eval.table), which the script writes after evaluating every checkpoint."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from megaopd.eval.table import main as table_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dry_run(env_extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "DRY_RUN", "MEGAOPD_", "ENGINE_")) and k not in ("GPUS_PER_NODE", "MASTER_PORT")
    }
    env.update({"DRY_RUN": "1", "DRY_RUN_NODES": "gpu1", **env_extra})
    return subprocess.run(
        ["bash", os.path.join(ROOT, "slurm", "eval_7b.sh")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )


def flag(line, name):
    m = re.search(rf"(?:^| ){re.escape(name)}[= ](\S+)", line)
    return m.group(1) if m else None


@pytest.fixture
def ckpts(tmp_path):
    hf = tmp_path / "base" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    steps = tmp_path / "run" / "checkpoints"
    for s in ("step_000010", "step_000020", "step_000030.tmp"):
        (steps / s).mkdir(parents=True)
        (steps / s / "megaopd_checkpoint.json").write_text("{}")
    (tmp_path / "bench").mkdir()
    return {"CKPT": f"{hf},{steps}", "EVAL_OUT": str(tmp_path / "out"), "BENCH_DIR": str(tmp_path / "bench")}


def test_dry_run_several_checkpoints_one_table(ckpts, tmp_path):
    r = dry_run(ckpts)
    assert r.returncode == 0, r.stderr
    batch = [x[len("[batch] ") :] for x in r.stdout.splitlines() if x.startswith("[batch] ")]
    evals = [x for x in batch if " megaopd.cli eval " in x]
    out = ckpts["EVAL_OUT"]
    # A row per checkpoint, in order; the unfinished step_000030.tmp is no checkpoint.
    assert [flag(x, "--label") for x in evals] == ["base-hf", "run-step_000010", "run-step_000020"]
    assert [flag(x, "--out") for x in evals] == [f"{out}/base-hf", f"{out}/run-step_000010", f"{out}/run-step_000020"]
    # The HF folder is served as it is; Megatron checkpoints are exported first, and their export is served.
    assert flag(evals[0], "--ckpt") == ckpts["CKPT"].split(",")[0]
    assert flag(evals[1], "--ckpt") == f"{out}/run-step_000010/hf"
    converts = [x for x in batch if "convert_megatron_to_hf.py" in x]
    assert [flag(x, "--out") for x in converts] == [f"{out}/run-step_000010/hf", f"{out}/run-step_000020/hf"]
    for e in evals:
        assert flag(e, "--benchmarks") == "math500,minerva,olympiadbench,amc,aime24,aime25"
        assert flag(e, "--samples") == "math500=1,minerva=1,olympiadbench=1,amc=32,aime24=32,aime25=32"
    # One SGLang server per GPU (4), on fresh ports per checkpoint, stopped before the next checkpoint's.
    servers = [x for x in r.stdout.splitlines() if x.startswith("[gpu1] ") and "sglang.launch_server" in x]
    assert len(servers) == 12
    assert [flag(x, "--base-gpu-id") for x in servers[:4]] == ["0", "1", "2", "3"]
    assert all(flag(x, "--tp-size") == "1" and flag(x, "--mem-fraction-static") == "0.85" for x in servers)
    assert not any("--enable-memory-saver" in x for x in servers)  # the servers own their GPUs
    assert flag(evals[0], "--engines") == ",".join(f"http://gpu1:{30000 + 10 * i}" for i in range(4))
    assert flag(evals[2], "--engines").startswith("http://gpu1:30200,")
    kinds = [
        "server" if "launch_server" in x else "eval" if " megaopd.cli eval " in x else "stop"
        for x in batch
        if "launch_server" in x or " megaopd.cli eval " in x or x.startswith("stop-engines")
    ]
    assert kinds == (["server"] * 4 + ["eval", "stop"]) * 3
    (table,) = [x for x in batch if "megaopd.eval.table" in x]
    assert table.split("megaopd.eval.table ")[1] == (
        f"{out}/base-hf {out}/run-step_000010 {out}/run-step_000020 --out {out}"
    )


def test_dry_run_tp_groups_and_errors(ckpts):
    r = dry_run({**ckpts, "ENGINE_TP": "2"})
    assert r.returncode == 0, r.stderr
    servers = [x for x in r.stdout.splitlines() if x.startswith("[gpu1] ") and "sglang.launch_server" in x]
    assert [(flag(x, "--tp-size"), flag(x, "--base-gpu-id")) for x in servers[:2]] == [("2", "0"), ("2", "2")]
    r = dry_run({**ckpts, "EVAL_OUT": ""})
    assert r.returncode == 1 and "EVAL_OUT is not set" in r.stderr
    r = dry_run({**ckpts, "CKPT": "/nonexistent/ckpt"})
    assert r.returncode == 1 and "CKPT entry /nonexistent/ckpt does not exist" in r.stderr
    r = dry_run({**ckpts, "ENGINE_BACKEND": "megaopd", "ENGINES_PER_NODE": "2", "GPUS_PER_NODE": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("megaopd.cli serve") == 2 * 3 * 2  # [batch] srun line + [gpu1] line, 2 per checkpoint


def write_result(path, label, accs):
    os.makedirs(path, exist_ok=True)
    benches = [{"name": n, "display": d, "accuracy": a} for n, d, a in accs]
    with open(os.path.join(path, "results.json"), "w") as f:
        json.dump({"label": label, "average": sum(a for *_, a in accs) / len(accs), "benchmarks": benches}, f)


def test_combined_table_in_paper_order(tmp_path, capsys):
    write_result(
        tmp_path / "a", "step_10", [("aime24", "AIME24", 0.1), ("math500", "MATH-500", 0.5), ("extra", "extra", 0.3)]
    )
    write_result(tmp_path / "b", "step_20", [("math500", "MATH-500", 0.625), ("minerva", "Minerva", 0.25)])
    assert table_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "t")]) == 0
    md = (tmp_path / "t" / "results.md").read_text()
    assert md == capsys.readouterr().out
    assert md.splitlines() == [
        "| Model | MATH-500 | Minerva | AIME24 | extra | Avg |",
        "|---|---:|---:|---:|---:|---:|",
        "| step_10 | 50.0 | - | 10.0 | 30.0 | 30.0 |",
        "| step_20 | 62.5 | 25.0 | - | - | 43.8 |",
    ]
    saved = json.load(open(tmp_path / "t" / "results.json"))
    assert saved["columns"][-1] == "Avg" and [r["label"] for r in saved["rows"]] == ["step_10", "step_20"]
    assert table_main([str(tmp_path / "missing")]) == 2
    assert "results.json not found" in capsys.readouterr().err
