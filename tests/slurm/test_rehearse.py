"""Rehearsals of the paper's job (REHEARSE=1 sbatch slurm/stable_opd_7b.sh, slurm/rehearse.sh) on 2 simulated
nodes of 4 simulated GPUs each (scripts/slurm_local.sh --nodes 2: network + UTS namespaces sim1, sim2).

Each case is the real script, common.sh and srun/torchrun path with tiny models, CPU ranks and `megaopd serve`
engines (docs/cluster.md, "Rehearsing a job"):
  - 2 nodes x 4 GPUs, colocated engines: ranks on both nodes, 3 steps, checkpoints; and its printed commands
    agree line for line with DRY_RUN=1's but for the differences rehearse.sh names;
  - ENGINE_NODES=1: sim1 trains on 4 ranks, sim2 only serves;
  - TEACHER_NODES=1: sim2 serves the teacher, the trainer scores remotely;
  - the time-limit signal: USR1 to the batch shell -> checkpoint -> `scontrol requeue` -> resume on the same 2
    nodes, with the same data order as the uninterrupted run;
  - a node's processes killed mid-step: the job fails (no hang, engines stopped), and requeued it resumes from
    the last complete checkpoint.
All slow; all but the paper shape also `cluster`: `make test-e2e` runs the paper shape and the comparison,
`make test-cluster` all of them (docs/cluster.md has their times). They skip, saying why, without consent
(MEGAOPD_SLURM_TESTS=1), root, Slurm (or apt-get to install it) or iproute2/util-linux.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.slurm.test_slurm import LAUNCHER_VARS, _foreign_config, job_info, lines_on, wait_for_state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "slurm", "stable_opd_7b.sh")
NODES = ["sim1", "sim2"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
# The trainer overrides a rehearsal appends (slurm/rehearse.sh, REHEARSE_DEVICE and REHEARSE_SIZE): the only
# keys its torchrun lines may add to the dry run's.
REHEARSAL_KEYS = {
    "student.dtype",
    "reference.dtype",
    "teacher.dtype",
    "optimizer.use_distributed_optimizer",
    "student.sequence_parallel",
    "reference.sequence_parallel",
    "teacher.sequence_parallel",
    "rollout.colocated",
    "trainer.max_steps",
    "trainer.save_interval",
    "trainer.prompts_per_step",
    "trainer.samples_per_prompt",
    "trainer.micro_batch_size",
    "data.max_prompt_len",
    "data.max_golden_len",
    "rollout.max_new_tokens",
    "validation.max_problems",
    "validation.max_new_tokens",
    "logging.tensorboard",
}

pytestmark = [pytest.mark.slow, pytest.mark.rehearsal]
# The cases past the paper shape are marked cluster: `make test-cluster` (-m rehearsal: this whole file), not
# `make test-e2e`.


@pytest.fixture(scope="session")
def sim_cluster():
    """The local cluster with 2 simulated nodes (scripts/slurm_local.sh --nodes 2; left running)."""
    if os.environ.get("MEGAOPD_SLURM_TESTS") != "1":
        pytest.skip(
            "rehearsal tests: set MEGAOPD_SLURM_TESTS=1 to let them install slurm-wlm + munge (apt) and start "
            "munged/slurmctld/slurmd with 2 simulated nodes on this machine (scripts/slurm_local.sh --nodes 2)"
        )
    if os.geteuid() != 0:
        pytest.skip("simulated nodes need root (network namespaces, slurmd per node)")
    if not shutil.which("sbatch") and not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and apt-get is not available to install it")
    missing = [t for t in ("ip", "nsenter", "unshare") if not shutil.which(t)]
    if missing:
        pytest.skip(f"simulated nodes need {', '.join(missing)} (iproute2, util-linux)")
    if _foreign_config():
        pytest.skip("/etc/slurm/slurm.conf was not written by scripts/slurm_local.sh: no simulated nodes added to it")
    t0 = time.time()
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "slurm_local.sh"), "--nodes", "2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"local Slurm cluster with 2 simulated nodes up in {time.time() - t0:.0f} s")
    return True


class Rehearsal:
    """One rehearsed job: submitted to the sim partition, its run folder, log and printed commands."""

    def __init__(self, tmp_path, name: str, env_extra: dict[str, str]):
        self.dir = tmp_path / name
        self.dir.mkdir()
        self.out = self.dir / "job.out"
        self.commands = self.dir / "commands.log"
        self.run_dir = self.dir / "runs" / "stable_opd_7b"
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "DRY_RUN", "REHEARSE")) and k not in LAUNCHER_VARS
        }
        for k in ("MODELS_DIR", "TRAIN_DATA", "CONFIG", "RUN_DIR", "ENGINE_NODES", "TEACHER_NODES", "MASTER_PORT"):
            self.env.pop(k, None)
        # The job runs in this test's Python environment, as a user's does after activating it.
        self.env.update(
            PATH=os.path.dirname(sys.executable) + os.pathsep + self.env.get("PATH", ""),
            PYTHON=sys.executable,
            MEGAOPD_ROOT=ROOT,
            OUTPUT_ROOT=str(self.dir / "runs"),
            REHEARSE_COMMANDS_LOG=str(self.commands),
        )
        self.env.update(env_extra)
        self.job_id: str | None = None
        self.seconds = 0.0

    def submit(self, *args: str) -> str:
        r = subprocess.run(
            ["sbatch", "--parsable", "-p", "sim", "--nodes=2", f"--output={self.out}", *args, SCRIPT],
            capture_output=True,
            text=True,
            env={**self.env, "REHEARSE": "1"},
            cwd=ROOT,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        self.job_id = r.stdout.strip().split(";")[0]
        self.t0 = time.time()
        return self.job_id

    def wait(self, timeout: float = 900) -> str:
        info = wait_for_state(self.job_id, ENDED, timeout)
        self.seconds = time.time() - self.t0
        return info

    def log(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    def steps(self) -> list[int]:
        return sorted({m["step"] for m in self.metrics() if "event" not in m and m["step"] > 0})

    def prompts(self, step: int) -> list[str]:
        path = self.run_dir / "samples" / f"step_{step:06d}.jsonl"
        return [json.loads(x)["prompt"] for x in path.read_text().splitlines() if x.strip()]

    def command_runs(self) -> list[list[str]]:
        """The printed commands, one list per run of the job (a requeued job appends a run)."""
        runs: list[list[str]] = []
        for line in self.commands.read_text().splitlines():
            if line.startswith("# run "):
                runs.append([])
            elif runs:
                runs[-1].append(line)
        return runs

    def cancel(self):
        if self.job_id:
            subprocess.run(["scancel", self.job_id], capture_output=True)


@pytest.fixture
def rehearse(sim_cluster, tmp_path):
    made: list[Rehearsal] = []

    def make(name: str, **env_extra: str) -> Rehearsal:
        r = Rehearsal(tmp_path, name, env_extra)
        made.append(r)
        return r

    yield make
    for r in made:
        r.cancel()


def _ranks_by_node(log: str) -> dict[str, list[int]]:
    ranks: dict[str, list[int]] = {}
    for rank, node in re.findall(r"megaopd train: rank (\d+)/\d+ on (\S+) ", log):
        ranks.setdefault(node, []).append(int(rank))
    return {n: sorted(r) for n, r in ranks.items()}


def _assert_trained(r: Rehearsal, steps: int = 3):
    log = r.log()
    assert r.steps() == list(range(1, steps + 1)), log[-4000:]
    assert (r.run_dir / "checkpoints" / "latest").exists(), sorted(os.listdir(r.run_dir))
    return log


@pytest.fixture(scope="module")
def colocated(sim_cluster, tmp_path_factory):
    """The paper's shape, rehearsed: 2 nodes x 4 GPUs, student TP=2 (DP=4), teacher TP=2, 8 colocated engines."""
    r = Rehearsal(tmp_path_factory.mktemp("colocated"), "colocated", {})
    try:
        r.submit()
        info = r.wait()
    finally:
        r.cancel()
    print(f"colocated 2x4 rehearsal: {r.seconds:.0f} s")
    assert "JobState=COMPLETED" in info, info + r.log()[-4000:]
    return r


def test_colocated_two_nodes_of_four(colocated):
    log = _assert_trained(colocated)
    # One rank per simulated GPU, 4 on each node, each saying where it runs.
    assert _ranks_by_node(log) == {"sim1": [0, 1, 2, 3], "sim2": [4, 5, 6, 7]}, log[-4000:]
    (run,) = colocated.command_runs()
    servers = [x for n in NODES for x in lines_on("\n".join(run), n) if " megaopd.cli serve " in x]
    assert len(servers) == 8  # 4 GPUs per node / ENGINE_TP 1, on both nodes
    for node in NODES:
        assert f"engine http://{node}:30030 is up" in log


def _dry_run(r: Rehearsal, master_port: str, **extra: str) -> subprocess.CompletedProcess:
    """DRY_RUN=1 of the same submission (no REHEARSE), on the rehearsal's inputs and allocation."""
    env = {
        **r.env,
        "DRY_RUN": "1",
        "DRY_RUN_NODES": " ".join(NODES),
        "MODELS_DIR": os.path.join(ROOT, "runs", "rehearse", "models"),
        "TRAIN_DATA": os.path.join(ROOT, "examples", "tiny", "data", "opd.jsonl"),
        "BENCH_DIR": os.path.join(ROOT, "runs", "rehearse", "bench"),
        "MASTER_PORT": master_port,
        # What the allocation gives each task (the dry run would otherwise count this machine's CPUs).
        "SLURM_CPUS_PER_TASK": "64",
        # The 7B preset on the tiny models, without the rehearsal's sizes, is no config the trainer accepts (its
        # rows exceed the tiny models' positions); the commands are what this compares, so no config check.
        "CONFIG_CHECK": "0",
        **extra,
    }
    env.pop("REHEARSE_COMMANDS_LOG", None)
    return subprocess.run(["bash", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)


def _server(line: str) -> str:
    """A server launch, reduced to what the rehearsal keeps: where it runs (srun's part), model and port."""
    m = re.search(r"(?:--model-path|--hf-dir) (\S+)", line)
    p = re.search(r" --port (\d+)", line)
    head = line.split(" env -u PYTORCH_CUDA_ALLOC_CONF ")[0] if " env -u " in line else ""
    return f"{head} <server {m.group(1)}:{p.group(1)}>"


def _split_overrides(dry: str, rehearsed: str) -> list[str]:
    """The rehearsal's torchrun/srun line is the dry run's plus appended overrides: returns them."""
    assert rehearsed.startswith(dry + " "), f"\n dry: {dry}\n run: {rehearsed}"
    return rehearsed[len(dry) + 1 :].split(" ")


def test_dry_run_and_rehearsal_agree_line_for_line(colocated):
    """Every command the rehearsal ran is the dry run's, in the same order on the same node, but for the named
    differences (slurm/rehearse.sh): `megaopd serve` for each SGLang server (same node, model folder, port) and
    the trainer overrides appended to the torchrun lines."""
    (run,) = colocated.command_runs()
    port = re.search(r"master sim1:(\d+)", colocated.log()).group(1)
    dry = _dry_run(colocated, port)
    assert dry.returncode == 0, dry.stderr
    for where in ["batch", *NODES]:
        want, got = lines_on(dry.stdout, where), lines_on("\n".join(run), where)
        assert len(want) == len(got), (where, want, got)
        for w, g in zip(want, got):
            if "sglang.launch_server" in w:
                assert " megaopd.cli serve " in g and _server(w) == _server(g), (w, g)
            elif "torchrun" in w:
                added = _split_overrides(w, g)
                assert {a.split("=", 1)[0] for a in added} <= REHEARSAL_KEYS, added
            else:
                assert w == g


@pytest.mark.cluster
@pytest.mark.timeout(1800)
def test_engine_nodes(rehearse):
    text = _split_job_commands(rehearse, "engine_nodes", ENGINE_NODES="1")
    assert [x for x in lines_on(text, "sim1") if " megaopd.cli serve " in x] == []
    assert len([x for x in lines_on(text, "sim2") if " megaopd.cli serve " in x]) == 4
    assert lines_on(text, "sim2") and all("torchrun" not in x for x in lines_on(text, "sim2"))


@pytest.mark.cluster
@pytest.mark.timeout(1800)
def test_teacher_nodes(rehearse):
    text = _split_job_commands(rehearse, "teacher_nodes", TEACHER_NODES="1")
    teacher = [x for x in lines_on(text, "sim2") if " megaopd.cli serve " in x]
    assert teacher and all("OpenThinker3-7B" in x for x in teacher)
    (train,) = [x for x in lines_on(text, "sim1") if x.startswith("torchrun ")]
    assert " teacher.engine=remote " in train and "'teacher.urls=[http://sim2:31000" in train


def _split_job_commands(rehearse, name: str, **env) -> str:
    """Rehearse a job whose second node serves (ENGINE_NODES=1 or TEACHER_NODES=1): it completes, trains with all
    four ranks on sim1, and ran one set of commands, returned as one text."""
    r = rehearse(name, **env)
    r.submit()
    info = r.wait()
    print(f"{' '.join(f'{k}={v}' for k, v in env.items())} rehearsal: {r.seconds:.0f} s")
    assert "JobState=COMPLETED" in info, info + r.log()[-4000:]
    log = _assert_trained(r)
    assert _ranks_by_node(log) == {"sim1": [0, 1, 2, 3]}, log[-4000:]
    (run,) = r.command_runs()
    return "\n".join(run)


def _wait_for(cond, what: str, r: Rehearsal, timeout: float = 600):
    deadline = time.time() + timeout
    while not cond():
        info = job_info(r.job_id)
        assert not any(f"JobState={s}" in info for s in ENDED), f"job ended before {what}:\n{info}{r.log()[-4000:]}"
        assert time.time() < deadline, f"no {what} after {timeout} s:\n{r.log()[-4000:]}"
        time.sleep(0.5)


@pytest.mark.cluster
@pytest.mark.timeout(1800)
def test_time_limit_signal_checkpoints_requeues_and_resumes(rehearse, colocated):
    """USR1 to the batch shell (what --signal=B:USR1@120 sends) after step 1: the ranks checkpoint and exit 0, the
    job requeues itself and resumes on the same 2 nodes, and steps 2-3 see the prompts of the uninterrupted run."""
    r = rehearse("usr1")
    r.submit()
    _wait_for(lambda: 1 in r.steps(), "step 1", r)
    subprocess.run(["scancel", "--signal=USR1", "--batch", r.job_id], check=True)
    info = r.wait()
    assert "JobState=COMPLETED" in info and re.search(r"Restarts=1\b", info), info + r.log()[-4000:]
    print(f"USR1 -> requeue -> resume rehearsal: {r.seconds:.0f} s")
    log = _assert_trained(r)
    assert "requeueing job" in log
    first, second = r.command_runs()
    for run in (first, second):  # the same nodes, each running its torchrun
        assert [len([x for x in lines_on("\n".join(run), n) if x.startswith("torchrun ")]) for n in NODES] == [1, 1]
    ckpt_events = [m["step"] for m in r.metrics() if m.get("event") == "checkpoint"]
    assert ckpt_events and min(ckpt_events) < 3, ckpt_events
    for step in (1, 2, 3):  # the same data order as the uninterrupted run
        assert r.prompts(step) == colocated.prompts(step), step


def _job_pids(job_id: str, node: str, what: bytes) -> list[int]:
    """The processes of the job on one node whose command line holds `what`."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if env.get(b"SLURM_JOB_ID") == job_id.encode() and env.get(b"SLURMD_NODENAME") == node.encode() and what in cmd:
            pids.append(int(pid))
    return pids


def _kill_node_ranks(job_id: str, node: str) -> list[int]:
    """SIGKILL to the training ranks and torchrun of one node of the job (what a node's crash does to them)."""
    killed = []
    for pid in _job_pids(job_id, node, b"megaopd.cli train"):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


@pytest.mark.cluster
@pytest.mark.timeout(1800)
def test_node_killed_mid_step_fails_cleanly_and_resumes(rehearse):
    """sim2's ranks and torchrun SIGKILLed after checkpoint 1: srun ends the step on both nodes, the job fails and
    stops its engines; requeued (scontrol requeue), it resumes from the last complete checkpoint."""
    r = rehearse("node_lost", REHEARSE_STEPS="4")
    r.submit()
    latest = r.run_dir / "checkpoints" / "latest"
    _wait_for(latest.exists, "a complete checkpoint", r)
    assert _kill_node_ranks(r.job_id, "sim2")
    t_kill = time.time()
    info = r.wait(timeout=300)
    failed_in = time.time() - t_kill
    assert "JobState=FAILED" in info, info + r.log()[-4000:]
    assert failed_in < 120, f"the job took {failed_in:.0f} s to fail after the node's ranks died"
    resumed_from = int(re.fullmatch(r"step_(\d+)", latest.read_text().strip()).group(1))  # its pointer file
    # Nothing of the job is left running: no rank, no engine.
    for node in NODES:
        assert _job_pids(r.job_id, node, b"megaopd.cli") == [], node
    first_seconds = r.seconds
    subprocess.run(["scontrol", "requeue", r.job_id], check=True)
    r.t0 = time.time()
    info = r.wait()
    print(f"node lost -> fail ({first_seconds:.0f} s) -> requeue -> resume ({r.seconds:.0f} s)")
    assert "JobState=COMPLETED" in info, info + r.log()[-4000:]
    log = _assert_trained(r, steps=4)
    assert re.search(rf"resumed from \S*step_0*{resumed_from} at step {resumed_from}\b", log), log[-4000:]
    assert len(r.command_runs()) == 2
