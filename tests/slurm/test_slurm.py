"""Slurm launch scripts (slurm/, scripts/slurm_local.sh).

Fast: `bash -n` on every script, #SBATCH headers, and DRY_RUN=1 with a fake 2- or 3-node allocation,
asserting on the per-node commands printed (torchrun ranks and master, SGLang lines, engine-only nodes,
the paper's settings) and on the one-line errors for missing inputs.
Slow (a real Slurm cluster on this machine, started by scripts/slurm_local.sh; skipped only when not root
or neither Slurm nor apt-get is there): sbatch --wait of a job that goes common.sh -> srun ->
torchrun_node.sh -> torchrun --nproc-per-node=2 -> a gloo all_reduce; the time-limit signal path
(USR1 to the batch shell -> ranks -> exit 0 -> requeue -> resume); and slurm/tiny_cpu.sh end to end.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from tests._cluster_inputs import cluster_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLURM = os.path.join(ROOT, "slurm")
SBATCH_SCRIPTS = [
    "stable_opd_7b.sh",
    "stable_opd_1p5b.sh",
    "opd_7b.sh",
    "sft_cold_start_7b.sh",
    "eval_7b.sh",
    "convert_7b.sh",
    "tiny_cpu.sh",
]
GPU_SCRIPTS = ["stable_opd_7b.sh", "stable_opd_1p5b.sh", "opd_7b.sh", "sft_cold_start_7b.sh", "eval_7b.sh"]
MODEL_DIRS = ["Qwen2.5-Math-7B", "Qwen2.5-Math-1.5B", "OpenThinker3-7B", "DeepSeek-R1-Distill-Qwen-7B"]


# ------------------------------------------------------------------------------------------------------
# Fast: syntax, headers, dry runs
# ------------------------------------------------------------------------------------------------------
def all_shell_scripts():
    files = glob.glob(os.path.join(SLURM, "*.sh")) + glob.glob(os.path.join(SLURM, "models", "*.sh"))
    return sorted(files) + [os.path.join(ROOT, "scripts", "slurm_local.sh")]


@pytest.mark.parametrize("path", all_shell_scripts(), ids=lambda p: os.path.relpath(p, ROOT))
def test_bash_syntax(path):
    r = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def sbatch_headers(script):
    with open(os.path.join(SLURM, script)) as f:
        return [line.split(None, 1)[1].strip() for line in f if line.startswith("#SBATCH")]


@pytest.mark.parametrize("script", SBATCH_SCRIPTS)
def test_sbatch_headers(script):
    h = sbatch_headers(script)
    name = script[:-3]
    for expected in (
        f"--job-name={name}",
        "--ntasks-per-node=1",
        "--output=logs/%x-%j.out",
        "--requeue",
        "--open-mode=append",
    ):
        assert expected in h, (script, expected, h)
    assert any(re.fullmatch(r"--nodes=\d+", x) for x in h)
    assert any(re.fullmatch(r"--cpus-per-task=\d+", x) for x in h)
    assert any(re.fullmatch(r"--time=[\d:-]+", x) for x in h)
    # Only the batch shell gets the warning signal: it forwards it to the trainer and requeues.
    assert any(re.fullmatch(r"--signal=B:USR1@\d+", x) for x in h)
    if script in GPU_SCRIPTS:
        assert "--gpus-per-node=4" in h
    else:
        assert not any(x.startswith("--gpus") for x in h)
    # #SBATCH lines are only read before the first command.
    with open(os.path.join(SLURM, script)) as f:
        lines = [x for x in f.read().splitlines() if x.strip()]
    first_cmd = next(i for i, x in enumerate(lines) if not x.startswith("#"))
    last_sbatch = max(i for i, x in enumerate(lines) if x.startswith("#SBATCH"))
    assert last_sbatch < first_cmd


@pytest.fixture
def inputs(tmp_path):
    """Paths a job needs, as empty stand-ins (a dry run checks they exist, it loads nothing)."""
    models = tmp_path / "models"
    for d in MODEL_DIRS:
        (models / d).mkdir(parents=True)
    (tmp_path / "train.parquet").touch()
    (tmp_path / "preset.yaml").touch()
    (tmp_path / "bench").mkdir()
    (tmp_path / "ckpt").mkdir()
    return {
        "MODELS_DIR": str(models),
        "TRAIN_DATA": str(tmp_path / "train.parquet"),
        "CONFIG": str(tmp_path / "preset.yaml"),
        "OUTPUT_ROOT": str(tmp_path / "runs"),
        "BENCH_DIR": str(tmp_path / "bench"),
        "CKPT": str(tmp_path / "ckpt"),
        "CKPT_ROOT": str(tmp_path / "converted"),
    }


# A job must not inherit the launch variables of whatever process runs the tests (a distributed test in
# the same pytest process, or a torchrun around it): they would pin its rendezvous port. Nor the thread count a
# pytest-xdist worker sets (tests/conftest.py): the scripts compute their own, and a test checks it.
LAUNCHER_VARS = {
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "OMP_NUM_THREADS",
    "OMP_THREAD_LIMIT",
}


def run_script(script, env_extra, *args, nodes="node1 node2", dry=True, check_config=False):
    """check_config=False: the stand-in inputs hold no model or data, so the trainer's config check
    (`megaopd config --strict`, slurm/common.sh check_config) is off unless a test asks for it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "DRY_RUN", "MEGAOPD_", "REHEARSE")) and k not in LAUNCHER_VARS
    }
    for k in (
        "MODELS_DIR",
        "TRAIN_DATA",
        "CONFIG",
        "OUTPUT_ROOT",
        "RUN_DIR",
        "ENGINE_NODES",
        "TEACHER",
        "GPUS_PER_NODE",
        "NPROC_PER_NODE",
        "MASTER_PORT",
        "STUDENT_HF_DIR",
        "TEACHER_HF_DIR",
        "CONFIG_CHECK",
        "PYTHON",
    ):
        env.pop(k, None)
    env["CONFIG_CHECK"] = "1" if check_config else "0"
    if check_config:
        env["PYTHON"] = sys.executable
    if dry:
        env["DRY_RUN"] = "1"
        if nodes:
            env["DRY_RUN_NODES"] = nodes
    env.update(env_extra)
    return subprocess.run(
        ["bash", os.path.join(SLURM, script), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )


def lines_on(out: str, where: str) -> list[str]:
    prefix = f"[{where}] "
    return [x[len(prefix) :] for x in out.splitlines() if x.startswith(prefix)]


def torchrun_lines(out, node):
    return [x for x in lines_on(out, node) if x.startswith("torchrun ")]


def sglang_lines(out, node):
    return [x for x in lines_on(out, node) if "sglang.launch_server" in x]


def flag(line, name):
    m = re.search(rf"(?:^| ){re.escape(name)}[= ](\S+)", line)
    return m.group(1) if m else None


def test_dry_run_two_nodes_colocated(inputs):
    r = run_script("stable_opd_7b.sh", inputs, "trainer.max_steps=7")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    t1, t2 = torchrun_lines(out, "node1"), torchrun_lines(out, "node2")
    assert len(t1) == len(t2) == 1
    for line, rank in ((t1[0], "0"), (t2[0], "1")):
        assert flag(line, "--nnodes") == "2"
        assert flag(line, "--nproc-per-node") == "4"
        assert flag(line, "--node-rank") == rank
        assert flag(line, "--master-addr") == "node1"
        assert flag(line, "--master-port") == "29500"
        assert " -m megaopd.cli train " in line
    train = t1[0]
    # The warning before the time limit: one step + one checkpoint + margin (slurm/common.sh).
    assert any(x.startswith("signal-timer USR1 1320s before-time-limit") for x in lines_on(out, "batch"))
    # The same command on both nodes apart from the rank.
    assert t1[0].replace("--node-rank=0", "") == t2[0].replace("--node-rank=1", "")
    # The layout; the paper's settings come from the preset (tests/config/test_paper_presets.py reads them),
    # so no size-dependent override is passed unless its variable is set.
    for absent in ("trainer.prompts_per_step=", "rollout.temperature=", "optimizer.lr=", "rollout.max_new_tokens="):
        assert absent not in train, absent
    for kv in (
        "run.world_size=8",
        "student.tp=2",
        "student.pp=1",
        "teacher.tp=2",
        "reference.tp=2",
        "rollout.engine=remote",
        "student.dtype=bfloat16",
        f"run.dir={inputs['OUTPUT_ROOT']}/stable_opd_7b",
        f"student.path={inputs['MODELS_DIR']}/Qwen2.5-Math-7B",
        f"teacher.path={inputs['MODELS_DIR']}/OpenThinker3-7B",
        "trainer.max_steps=7",
    ):
        assert f" {kv}" in train, kv
    assert f"'data.sources=[{{path: {inputs['TRAIN_DATA']}, weight: 1.0}}]'" in train
    # Colocated engines: one SGLang server per GPU on every training node, memory saver on.
    urls = []
    for node in ("node1", "node2"):
        eng = sglang_lines(out, node)
        assert len(eng) == 4
        assert sorted(flag(x, "--base-gpu-id") for x in eng) == ["0", "1", "2", "3"]
        for x in eng:
            assert "--enable-memory-saver" in x
            assert flag(x, "--mem-fraction-static") == "0.5"
            assert flag(x, "--tp-size") == "1"
            assert flag(x, "--model-path") == f"{inputs['MODELS_DIR']}/Qwen2.5-Math-7B"
            assert flag(x, "--host") == "0.0.0.0"
            urls.append(f"http://{node}:{flag(x, '--port')}")
    assert f"'rollout.urls=[{','.join(urls)}]'" in train
    # The batch shell waits for every engine before training, and starts both with srun on their node.
    batch = lines_on(out, "batch")
    waits = [x.split()[-1] for x in batch if x.startswith("wait-for-health")]
    assert waits == [u + "/health" for u in urls]
    srun_train = [x for x in batch if x.startswith("srun ") and "torchrun_node.sh" in x]
    assert len(srun_train) == 1
    assert "--nodes=2" in srun_train[0] and "--ntasks-per-node=1" in srun_train[0]
    assert "--nodelist=node1,node2" in srun_train[0]
    order = [i for i, x in enumerate(batch) if x.startswith("wait-for-health")]
    assert max(order) < batch.index(srun_train[0])
    assert all("--overlap" in x for x in batch if x.startswith("srun "))


def test_dry_run_engine_nodes(inputs):
    r = run_script("stable_opd_7b.sh", {**inputs, "ENGINE_NODES": "1"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # node1 trains alone; node2 only serves.
    assert sglang_lines(out, "node1") == []
    assert torchrun_lines(out, "node2") == []
    (train,) = torchrun_lines(out, "node1")
    assert flag(train, "--nnodes") == "1" and flag(train, "--node-rank") == "0"
    assert flag(train, "--master-addr") == "node1"
    assert " run.world_size=4 " in train
    # One task on the one training node: srun would otherwise take the job's 2 tasks (SLURM_NTASKS) onto it and
    # refuse the step (seen in the ENGINE_NODES=1 rehearsal, tests/slurm/test_rehearse.py).
    (srun,) = [x for x in lines_on(out, "batch") if x.startswith("srun ") and "torchrun_node.sh" in x]
    assert "--nodes=1 --ntasks=1 " in srun
    eng = sglang_lines(out, "node2")
    assert len(eng) == 4
    for x in eng:
        assert "--enable-memory-saver" not in x  # dedicated engines never give their memory away
        assert flag(x, "--mem-fraction-static") == "0.85"
    urls = ",".join(f"http://node2:{30000 + 10 * i}" for i in range(4))
    assert f"'rollout.urls=[{urls}]'" in train


def test_dry_run_three_nodes_one_engine_node(inputs):
    defaults = {k: v for k, v in inputs.items() if k != "CONFIG"}  # the job's own preset
    r = run_script(
        "opd_7b.sh",
        {**defaults, "ENGINE_NODES": "1", "ENGINE_TP": "2", "TEACHER": "r1-distill-qwen-7b", "MASTER_PORT": "31234"},
        nodes="a b c",
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    ranks = {n: torchrun_lines(out, n) for n in "abc"}
    assert [flag(ranks[n][0], "--node-rank") for n in "ab"] == ["0", "1"] and ranks["c"] == []
    for n in "ab":
        assert flag(ranks[n][0], "--nnodes") == "2" and flag(ranks[n][0], "--master-addr") == "a"
        assert flag(ranks[n][0], "--master-port") == "31234"
        assert "/examples/paper/opd_7b.yaml " in ranks[n][0]  # plain OPD: its own paper preset
        assert f"teacher.path={inputs['MODELS_DIR']}/DeepSeek-R1-Distill-Qwen-7B" in ranks[n][0]
    eng = sglang_lines(out, "c")
    assert [flag(x, "--tp-size") for x in eng] == ["2", "2"]
    assert [flag(x, "--base-gpu-id") for x in eng] == ["0", "2"]


def test_dry_run_tiny_cpu(tmp_path):
    (tmp_path / "p.yaml").touch()
    r = run_script(
        "tiny_cpu.sh",
        {"RUN_DIR": str(tmp_path / "run"), "CONFIG": str(tmp_path / "p.yaml"), "MAX_STEPS": "2"},
        nodes="cpu1",
    )
    assert r.returncode == 0, r.stderr
    (line,) = torchrun_lines(r.stdout, "cpu1")
    assert flag(line, "--nproc-per-node") == "2" and flag(line, "--nnodes") == "1"
    assert f" train {tmp_path}/p.yaml run.dir={tmp_path}/run run.world_size=2 trainer.max_steps=2" in line
    assert "sglang" not in r.stdout  # the tiny job generates inside the trainer


@pytest.mark.parametrize(
    "script,preset",
    [
        ("stable_opd_7b.sh", "stable_opd_7b"),
        ("stable_opd_1p5b.sh", "stable_opd_1p5b"),
        ("opd_7b.sh", "opd_7b"),
        ("sft_cold_start_7b.sh", "sft_cold_start_7b"),
    ],
)
def test_paper_jobs_run_their_paper_preset_by_default(inputs, script, preset):
    defaults = {k: v for k, v in inputs.items() if k != "CONFIG"}
    r = run_script(script, {**defaults, "LR": "2e-6", "SIGNAL_LEAD_S": "600"})
    assert r.returncode == 0, r.stderr
    (train,) = torchrun_lines(r.stdout, "node1")
    assert f" train {ROOT}/examples/paper/{preset}.yaml " in train
    assert " optimizer.lr=2e-6" in train  # a set variable still overrides the preset
    assert any(x.startswith("signal-timer USR1 600s") for x in lines_on(r.stdout, "batch"))


@pytest.mark.parametrize("script", ["stable_opd_1p5b.sh", "sft_cold_start_7b.sh", "eval_7b.sh", "convert_7b.sh"])
def test_dry_run_other_scripts(script, inputs):
    r = run_script(script, inputs)
    assert r.returncode == 0, r.stderr
    node1 = "\n".join(lines_on(r.stdout, "node1"))
    if script == "stable_opd_1p5b.sh":
        assert f"student.path={inputs['MODELS_DIR']}/Qwen2.5-Math-1.5B" in node1
        assert f"teacher.path={inputs['MODELS_DIR']}/DeepSeek-R1-Distill-Qwen-7B" in node1
        assert "student.tp=1" in node1
    elif script == "sft_cold_start_7b.sh":
        assert "sglang" not in r.stdout  # the SFT preset (loss.name=sft, embedded engine) starts no engines
        assert len(torchrun_lines(r.stdout, "node2")) == 1
    elif script == "eval_7b.sh":
        # An empty CKPT is no HF folder: exported once, then one SGLang server per GPU of the first node and
        # one `megaopd eval --engines` over them for all six benchmarks (tests/eval/test_eval_slurm.py).
        assert "convert_megatron_to_hf.py" in node1
        (step,) = [x for x in lines_on(r.stdout, "batch") if " megaopd.cli eval " in x]
        assert flag(step, "--samples") == "math500=1,minerva=1,olympiadbench=1,amc=32,aime24=32,aime25=32"
        # One server per GPU on every node of the allocation (2 nodes x 4 GPUs).
        assert len(sglang_lines(r.stdout, "node1")) == len(sglang_lines(r.stdout, "node2")) == 4
        assert len(flag(step, "--engines").split(",")) == 8
    else:
        assert f"--out {inputs['CKPT_ROOT']}/Qwen2.5-Math-7B-tp2-pp1 --tp 2 --pp 1" in node1
        assert f"--out {inputs['CKPT_ROOT']}/OpenThinker3-7B-tp2-pp1" in node1


@pytest.mark.parametrize(
    "drop,messages",
    [
        ("TRAIN_DATA", ["TRAIN_DATA is not set"]),
        ("MODELS_DIR", ["STUDENT_HF_DIR is not set", "TEACHER_HF_DIR is not set"]),  # one line per variable
        ("OUTPUT_ROOT", ["OUTPUT_ROOT is not set"]),
        ("CONFIG", ["does not exist"]),  # the default preset path, absent in this stand-in setup or not
    ],
)
def test_missing_input_is_one_clear_error(inputs, drop, messages):
    env = dict(inputs)
    del env[drop]
    if drop == "CONFIG":
        env["CONFIG"] = "/nonexistent/preset.yaml"
    r = run_script("stable_opd_7b.sh", env)
    assert r.returncode == 1
    errors = [x for x in r.stderr.splitlines() if "error:" in x]
    assert len(errors) == len(messages) and all(m in e for m, e in zip(messages, errors)), r.stderr
    assert "torchrun" not in r.stdout and "sglang" not in r.stdout


@pytest.mark.parametrize(
    "script,drop,variables",
    [
        (
            "stable_opd_7b.sh",
            ["MODELS_DIR", "TRAIN_DATA", "OUTPUT_ROOT"],
            ["STUDENT_HF_DIR", "TEACHER_HF_DIR", "OUTPUT_ROOT", "TRAIN_DATA"],
        ),
        (
            "sft_cold_start_7b.sh",
            ["MODELS_DIR", "TRAIN_DATA", "OUTPUT_ROOT"],
            ["STUDENT_HF_DIR", "OUTPUT_ROOT", "TRAIN_DATA"],
        ),
        ("eval_7b.sh", ["CKPT", "BENCH_DIR"], ["CKPT", "BENCH_DIR"]),
        ("convert_7b.sh", ["CKPT_ROOT", "MODELS_DIR"], ["CKPT_ROOT", "MODEL_HF_DIR"]),
        ("tiny_cpu.sh", ["OUTPUT_ROOT", "CONFIG"], ["CONFIG", "OUTPUT_ROOT"]),
    ],
)
def test_every_missing_input_is_reported_at_once(inputs, script, drop, variables):
    """slurm/README.md: each missing input is one error line, all of them in one try (issue 54)."""
    env = {k: v for k, v in inputs.items() if k not in drop}
    if "CONFIG" in drop:
        env["CONFIG"] = "/nonexistent/preset.yaml"
    r = run_script(script, env)
    assert r.returncode == 1, r.stderr
    errors = [x for x in r.stderr.splitlines() if "error:" in x]
    assert [e.split("error: ")[1].split(" ")[0].split("=")[0] for e in errors] == variables, r.stderr
    assert not any(x.startswith("[") for x in r.stdout.splitlines()), r.stdout  # nothing would have started


@pytest.fixture
def real_inputs(tmp_path):
    """Inputs `megaopd config --strict` accepts: the 7B models' config.json (tests/config/fixtures; the
    student's context extended as docs/cluster.md says), a data row and a validation set."""
    return cluster_inputs(tmp_path, {"Qwen2.5-Math-7B": "qwen2.5-math-7b", "OpenThinker3-7B": "openthinker3-7b"})


@pytest.mark.parametrize(
    "setting,reason",
    [
        ({}, None),
        ({"LR": "abc"}, "optimizer.lr"),
        ({"STUDENT_TP": "3"}, "student.tp=3 does not divide"),
    ],
    ids=["good", "LR=abc", "STUDENT_TP=3"],
)
def test_dry_run_checks_the_trainer_config_before_any_engine(real_inputs, setting, reason):
    """Issue 53: the job runs `megaopd config --strict` on the trainer's exact arguments before it starts any
    engine, so a bad setting fails in seconds, DRY_RUN=1 included, and nothing is written to the run folder."""
    r = run_script("stable_opd_7b.sh", {**real_inputs, **setting}, check_config=True)
    run_dir = os.path.join(real_inputs["OUTPUT_ROOT"], "stable_opd_7b")
    if reason is None:
        assert r.returncode == 0, r.stderr
        assert "trainer config checked" in r.stderr
        assert len(torchrun_lines(r.stdout, "node1")) == 1
        return
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [x for x in r.stderr.splitlines() if "error:" in x]
    assert len(errors) == 1 and "refuses this job's config" in errors[0] and reason in errors[0], r.stderr
    assert len(sglang_lines(r.stdout, "node1") + sglang_lines(r.stdout, "node2")) == 8  # printed as planned ...
    assert "wait-for-health" not in r.stdout and "torchrun" not in r.stdout  # ... but none started
    assert not os.path.exists(run_dir)


def test_real_job_checks_the_config_before_starting_engines(real_inputs, tmp_path):
    """Outside DRY_RUN (a fake allocation of one node: srun is a stub that records its calls) a refused config
    stops the job before the first srun."""
    stub = tmp_path / "bin"
    stub.mkdir()
    calls = tmp_path / "srun_calls"
    (stub / "srun").write_text(f'#!/bin/bash\necho "$*" >> {calls}\n')
    (stub / "srun").chmod(0o755)
    (stub / "scontrol").write_text("#!/bin/bash\necho node1\n")
    (stub / "scontrol").chmod(0o755)
    env = {
        **real_inputs,
        "LR": "abc",
        "SLURM_JOB_NODELIST": "node1",
        "GPUS_PER_NODE": "4",
        "PATH": f"{stub}:{os.environ['PATH']}",
    }
    r = run_script("stable_opd_7b.sh", env, nodes=None, dry=False, check_config=True)
    assert r.returncode == 1 and "optimizer.lr" in r.stderr, r.stderr
    assert not calls.exists()  # no engine, no training step
    assert not os.path.exists(os.path.join(real_inputs["OUTPUT_ROOT"], "stable_opd_7b"))


def test_missing_path_names_the_variable(inputs):
    r = run_script("stable_opd_7b.sh", {**inputs, "TRAIN_DATA": "/nonexistent/train.parquet"})
    assert r.returncode == 1
    assert "TRAIN_DATA=/nonexistent/train.parquet does not exist" in r.stderr
    r = run_script("stable_opd_7b.sh", {**inputs, "TEACHER": "gpt-9"})
    assert r.returncode == 1 and "no model settings for 'gpt-9'" in r.stderr and "openthinker3-7b" in r.stderr


def test_bad_allocations(inputs):
    r = run_script("stable_opd_7b.sh", {**inputs, "ENGINE_NODES": "2"})
    assert r.returncode == 1 and "leaves no node for training" in r.stderr
    r = run_script("stable_opd_7b.sh", {**inputs, "ENGINE_TP": "3"})
    assert r.returncode == 1 and "ENGINE_TP=3 does not divide the 4 GPUs" in r.stderr
    # Outside a job, without DRY_RUN: refuse, and say how to preview.
    r = run_script("stable_opd_7b.sh", inputs, dry=False)
    assert r.returncode == 1 and "not inside a Slurm allocation" in r.stderr and "DRY_RUN=1" in r.stderr
    r = run_script("stable_opd_7b.sh", {**inputs, "DRY_RUN": "0", "DRY_RUN_NODES": "a b"}, dry=False)
    assert r.returncode == 1 and "only honored with DRY_RUN=1" in r.stderr


# ------------------------------------------------------------------------------------------------------
# Slow: a real Slurm cluster on this machine
# ------------------------------------------------------------------------------------------------------
def _node_ready():
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and any(s in r.stdout for s in ("idle", "mixed", "allocated"))


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local cluster of scripts/slurm_local.sh (installed and started when needed; left running).

    Only with consent: it installs slurm-wlm and munge with apt and leaves munged, slurmctld and slurmd
    running, so these tests skip unless MEGAOPD_SLURM_TESTS=1 (CI sets it; `make test-e2e` passes it on)."""
    if os.environ.get("MEGAOPD_SLURM_TESTS") != "1":
        pytest.skip(
            "real-Slurm tests: set MEGAOPD_SLURM_TESTS=1 to let them install slurm-wlm + munge (apt) "
            "and start munged/slurmctld/slurmd on this machine (scripts/slurm_local.sh; CI sets it)"
        )
    if os.geteuid() != 0:  # a cluster someone else runs, or none
        if not _node_ready():
            pytest.skip("the local Slurm cluster needs root (scripts/slurm_local.sh starts munged, slurmctld, slurmd)")
        return True
    if not shutil.which("sbatch") and not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and apt-get is not available to install it")
    if _foreign_config():  # a cluster of its own (a package's or a site's config): used as it is, never rewritten
        if not _node_ready():
            pytest.skip("/etc/slurm/slurm.conf was not written by scripts/slurm_local.sh and its node is not ready")
        return True
    # Run every time, also when the cluster is up: then it takes a second, and it restarts the daemons when the
    # config it writes differs from the one they run (another CPU count, an older checkout's config).
    t0 = time.time()
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "slurm_local.sh")], capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"local Slurm cluster up in {time.time() - t0:.0f} s")
    return True


def _foreign_config(path="/etc/slurm/slurm.conf"):
    """A slurm.conf that scripts/slurm_local.sh did not write, and may not overwrite."""
    if os.environ.get("SLURM_LOCAL_FORCE") == "1" or not os.path.exists(path):
        return False
    try:
        with open(path) as f:
            return not any(line.startswith("# Written by scripts/slurm_local.sh") for line in f)
    except OSError:
        return True


def job_info(job_id):
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout


def wait_for_state(job_id, states, timeout):
    deadline = time.time() + timeout
    while True:
        info = job_info(job_id)
        m = re.search(r"JobState=(\S+)", info)
        if m and m.group(1) in states:
            return info
        assert time.time() < deadline, f"job {job_id} not in {states} after {timeout}s:\n{info}"
        time.sleep(0.5)


class Jobs:
    """Submitted job ids, cancelled at the end of the test whatever happened."""

    def __init__(self):
        self.ids = []

    def sbatch(self, script, env_extra, *args, wait=True, timeout=600):
        """Submits; with wait, returns (job id, exit code) once the job ended. Polls scontrol every 0.5 s
        rather than `sbatch --wait`, whose growing poll interval adds ~20 s to every short job."""
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DRY_RUN")) and k not in LAUNCHER_VARS
        }
        # The job runs in this test's Python environment, as a user's does after `source .venv/bin/activate`
        # (sbatch exports the submitting environment): its torchrun and python first on PATH.
        bin_dir = os.path.dirname(sys.executable)
        env.update(PATH=bin_dir + os.pathsep + env.get("PATH", ""), PYTHON=sys.executable)
        env.update(env_extra, MEGAOPD_ROOT=ROOT)
        r = subprocess.run(
            ["sbatch", "--parsable", *args, script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
        )
        assert r.returncode == 0, r.stderr
        job_id = r.stdout.strip().split(";")[0]
        self.ids.append(job_id)
        if not wait:
            return job_id, None
        state = wait_for_state(
            job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"), timeout
        )
        if "JobState=COMPLETED" in state:
            return job_id, 0
        m = re.search(r"ExitCode=(\d+):(\d+)", state)
        return job_id, int(m.group(1)) or int(m.group(2)) or -1 if m else -1

    def cancel_all(self):
        for j in self.ids:
            subprocess.run(["scancel", j], capture_output=True)


@pytest.fixture
def jobs(slurm_cluster):
    j = Jobs()
    yield j
    j.cancel_all()


PROBE_JOB = """#!/bin/bash
#SBATCH --job-name=megaopd_probe
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:10:00
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
#SBATCH --open-mode=append
# Two gloo ranks on the one CPU node, through common.sh's own launch path.
GPUS_PER_NODE=0
NPROC_PER_NODE=2
source "$MEGAOPD_ROOT/slurm/common.sh"
RUN_DIR="{out}"
setup_run_dir
export TRAIN_MODULE=tests.slurm._probe
run_torchrun "{out}" {mode}
"""


def write_probe(tmp_path, mode):
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "probe.sh"
    script.write_text(PROBE_JOB.format(out=out, mode=mode))
    return out, str(script)


def read_reports(out):
    return sorted(
        (json.load(open(p)) for p in glob.glob(str(out / "rank*-run*.json"))), key=lambda r: (r["run"], r["rank"])
    )


@pytest.mark.slow
def test_sbatch_srun_torchrun_gloo_allreduce(jobs, tmp_path):
    out, script = write_probe(tmp_path, "allreduce")
    job_id, rc = jobs.sbatch(script, {}, f"--output={tmp_path}/job.out", timeout=300)
    log = (tmp_path / "job.out").read_text()
    assert rc == 0, log
    reports = read_reports(out)
    assert [r["rank"] for r in reports] == [0, 1], log
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    for r in reports:
        assert r["world_size"] == 2 and r["sum"] == 3.0  # 1 + 2: both ranks took part
        assert r["node_rank"] == 0 and r["local_rank"] == r["rank"]
        assert r["master_addr"] == host  # the first (only) node of the allocation
        assert r["master_port"] == str(20000 + int(job_id) % 9000)
        assert r["job_id"] == job_id
        assert r["omp_num_threads"] == "1"  # 2 CPUs shared by 2 ranks
        assert r["cuda_device_max_connections"] == "1"
    assert f"job megaopd_probe: 1 node(s) [{host}]" in log


@pytest.mark.slow
def test_time_limit_signal_checkpoints_and_requeues(jobs, tmp_path):
    """USR1 to the batch shell only (what --signal=B:USR1@N does) -> the ranks get it and exit 0 -> the job
    requeues itself -> the second run finds the checkpoint marker and finishes."""
    out, script = write_probe(tmp_path, "usr1")
    job_id, _ = jobs.sbatch(script, {}, f"--output={tmp_path}/job.out", wait=False)
    deadline = time.time() + 120
    while not (os.path.exists(out / "ready0") and os.path.exists(out / "ready1")):
        assert time.time() < deadline, "ranks did not start: " + (tmp_path / "job.out").read_text()
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    # The job requeues itself. Slurm holds a requeued job until its old credential expires (Reason=BeginTime;
    # cred_expire, 15 s on the local cluster): forcing an earlier start makes slurmd refuse it ("Job
    # credential revoked") and the job fails, so let it start by itself.
    info = wait_for_state(job_id, ("PENDING", "COMPLETED", "FAILED", "CANCELLED"), 120)
    assert "JobState=PENDING" in info and re.search(r"Restarts=1\b", info), info
    state = wait_for_state(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300)
    log = (tmp_path / "job.out").read_text()
    assert "JobState=COMPLETED" in state, state + log
    assert re.search(r"Restarts=1\b", state), state
    reports = read_reports(out)
    first = [r for r in reports if r["run"] == 0]
    second = [r for r in reports if r["run"] == 1]
    assert [r.get("usr1") for r in first] == [True, True], log
    assert [r.get("resumed") for r in second] == [True, True], log
    assert "requeueing job" in log


TIMER_JOB = """#!/bin/bash
#SBATCH --job-name=megaopd_timer
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:02:00
#SBATCH --signal=B:USR1@5
#SBATCH --requeue
#SBATCH --open-mode=append
# common.sh's own warning timer (SIGNAL_LEAD_S before the limit), not Slurm's --signal (5 s, a backstop).
GPUS_PER_NODE=0
NPROC_PER_NODE=2
SIGNAL_LEAD_S=95
source "$MEGAOPD_ROOT/slurm/common.sh"
RUN_DIR="{out}"
setup_run_dir
export TRAIN_MODULE=tests.slurm._probe
start_signal_timer
run_torchrun "{out}" usr1
"""


@pytest.mark.slow
def test_signal_lead_timer_checkpoints_and_requeues(jobs, tmp_path):
    """The batch shell's timer sends USR1 SIGNAL_LEAD_S (95 s) before a 2-minute limit, ~25 s in, long before
    Slurm's own 5-s warning: the ranks exit 0, the job requeues and the second run resumes."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "timer.sh"
    script.write_text(TIMER_JOB.format(out=out))
    job_id, _ = jobs.sbatch(str(script), {}, f"--output={tmp_path}/job.out", wait=False)
    wait_for_state(job_id, ("RUNNING",), 60)
    t0 = time.time()
    info = wait_for_state(job_id, ("PENDING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 150)
    first_run_s = time.time() - t0
    log = (tmp_path / "job.out").read_text()
    assert "JobState=PENDING" in info and re.search(r"Restarts=1\b", info), info + log
    assert first_run_s < 90, f"USR1 came after {first_run_s:.0f} s: the timer did not fire first\n{log}"
    assert re.search(r"USR1 in \d+s: 95s before the time limit", log), log
    state = wait_for_state(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300)
    log = (tmp_path / "job.out").read_text()
    assert "JobState=COMPLETED" in state, state + log
    reports = read_reports(out)
    assert [r.get("usr1") for r in reports if r["run"] == 0] == [True, True], log
    assert [r.get("resumed") for r in reports if r["run"] == 1] == [True, True], log


ENGINE_JOB = """#!/bin/bash
#SBATCH --job-name=megaopd_engines
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:10:00
# common.sh's engine path for real, with `megaopd serve` standing in for SGLang (no GPU here).
GPUS_PER_NODE=0
NPROC_PER_NODE=2
source "$MEGAOPD_ROOT/slurm/common.sh"
RUN_DIR="{out}"
setup_run_dir
ENGINE_BACKEND=megaopd ENGINES_PER_NODE=2 ENGINE_PORT={port} STUDENT_HF_DIR="{hf}"
start_engines STUDENT_HF_DIR
printf '%s\\n' "${{ROLLOUT_OVERRIDES[@]}}" > "{out}/overrides.txt"
for url in "${{ENGINE_URLS[@]}}"; do  # the key start_engines made for the job (the servers bind 0.0.0.0)
  curl -sf -H "Authorization: Bearer $MEGAOPD_API_KEY" "$url/get_model_info" >> "{out}/model_info.txt"
done
export TRAIN_MODULE=tests.slurm._probe
run_torchrun "{out}" allreduce "${{ROLLOUT_OVERRIDES[@]}}"
"""


@pytest.mark.slow
def test_engines_start_wait_and_stop(jobs, tmp_path):
    """start_engines for real: one srun step per engine on its node, /health waited for, URLs handed to the
    trainer, the servers stopped when the batch shell exits."""
    from tests.engine._models import build_tiny_qwen2

    hf = build_tiny_qwen2(tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    port = 31000 + os.getpid() % 1000 * 20
    script = tmp_path / "engines.sh"
    script.write_text(ENGINE_JOB.format(out=out, hf=hf, port=port))
    job_id, rc = jobs.sbatch(str(script), {}, f"--output={tmp_path}/job.out", timeout=300)
    log = (tmp_path / "job.out").read_text()
    assert rc == 0, log
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    urls = [f"http://{host}:{port}", f"http://{host}:{port + 10}"]
    assert (out / "overrides.txt").read_text().split() == [
        "rollout.engine=remote",
        f"rollout.urls=[{','.join(urls)}]",
        "rollout.engine_tp=1",
        f"rollout.weight_sync_address={host}",
        "rollout.colocated=true",
        "plan.engine_memory_fraction=0.5",
    ]
    assert (out / "model_info.txt").read_text().count("model_path") == 2
    assert [r["sum"] for r in read_reports(out)] == [3.0, 3.0]
    for u in urls:
        assert f"engine {u} is up" in log
        assert sorted(glob.glob(str(out / "logs" / "engine-*.log")))
    # The batch shell's exit stopped both servers.
    for u in urls:
        r = subprocess.run(["curl", "-sf", "--max-time", "2", f"{u}/health"], capture_output=True)
        assert r.returncode != 0, f"{u} still answers after the job ended"


@pytest.mark.slow
def test_tiny_cpu_job_end_to_end(tmp_path, request):
    jobs = request.getfixturevalue("jobs")  # starts the cluster only when the test can run
    run = tmp_path / "run"
    job_id, rc = jobs.sbatch(
        os.path.join(SLURM, "tiny_cpu.sh"),
        {"RUN_DIR": str(run), "MAX_STEPS": "2"},
        f"--output={tmp_path}/job.out",
        timeout=840,
    )
    log = (tmp_path / "job.out").read_text()
    assert rc == 0, log[-4000:]
    metrics = run / "metrics.jsonl"
    assert metrics.exists() and metrics.read_text().strip(), log[-4000:]
    assert os.path.exists(run / "checkpoints" / "latest"), sorted(os.listdir(run))


def test_dry_run_teacher_nodes(inputs):
    """TEACHER_NODES=1: the last node serves the teacher (SGLang prefill scoring), the trainer reads it remotely."""
    r = run_script("stable_opd_7b.sh", {**inputs, "TEACHER_NODES": "1"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert torchrun_lines(out, "node2") == []
    (train,) = torchrun_lines(out, "node1")
    assert " run.world_size=4 " in train
    teacher = sglang_lines(out, "node2")
    assert teacher and all("OpenThinker3-7B" in x and "--enable-memory-saver" not in x for x in teacher)
    tp = int(flag(teacher[0], "--tp-size"))
    assert len(teacher) == 4 // tp
    urls = ",".join(f"http://node2:{31000 + 10 * i}" for i in range(4 // tp))
    assert " teacher.engine=remote " in train and f"'teacher.urls=[{urls}]'" in train
    assert all("Qwen2.5-Math-7B" in x for x in sglang_lines(out, "node1"))  # rollout engines stay colocated
    r = run_script("stable_opd_7b.sh", {**inputs, "TEACHER_NODES": "2"})
    assert r.returncode != 0 and "TEACHER_NODES=2" in r.stderr and "--nodes=3" in r.stderr


@pytest.mark.parametrize("script", SBATCH_SCRIPTS)
def test_every_script_has_a_rehearsal(script, tmp_path):
    """REHEARSE=1 (slurm/rehearse.sh) previews on every sbatch script, with the real models and data replaced by
    the tiny ones (no MODELS_DIR, TRAIN_DATA, BENCH_DIR or CKPT given): no SGLang server, `megaopd serve` in its
    place, and the CPU settings on every trainer line. The real runs: tests/slurm/test_rehearse.py."""
    env = {"REHEARSE": "1", "OUTPUT_ROOT": str(tmp_path / "runs"), "CKPT_ROOT": str(tmp_path / "ckpt")}
    if script == "tiny_cpu.sh":
        env["RUN_DIR"] = str(tmp_path / "tiny")
    r = run_script(script, env, nodes="sim1 sim2")
    assert r.returncode == 0, r.stderr
    assert "sglang" not in r.stdout
    tiny = os.path.join(ROOT, "examples", "tiny")
    for node in ("sim1", "sim2"):
        for line in torchrun_lines(r.stdout, node):
            assert line.endswith(" logging.tensorboard=false") and " student.dtype=float32 " in line, line
            assert " rollout.colocated=false " in line and " trainer.max_steps=3 " in line
        for line in lines_on(r.stdout, node):
            if " megaopd.cli serve " in line:
                hf = flag(line, "--hf-dir")
                assert os.path.realpath(hf).startswith(os.path.join(tiny, "models")), line
    if script == "eval_7b.sh":
        (step,) = [x for x in lines_on(r.stdout, "batch") if " megaopd.cli eval " in x]
        assert " --limit 4" in step and flag(step, "--out").startswith(str(tmp_path / "runs"))
