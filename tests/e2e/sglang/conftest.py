"""Servers of the SGLang tier: SGLang 0.5.23's own server on this CPU, and `megaopd serve` beside it.

    pytest -m slow tests/e2e/sglang            # make test-e2e runs it; -m "not sglang" leaves it out

One server per model and kind for the whole session (starting SGLang takes 15-60 s here): the tiny student
(examples/tiny/models/student) behind SGLang and behind `megaopd serve`, and the tiny teacher and the teacher
of another tokenizer (teacher_xtok) behind SGLang (each started only when a test needs it). SGLang's venv
comes from scripts/install_sglang.sh, which this tier runs when it is missing (about 4 minutes and 2.7 GB,
then cached): the tests never skip for want of it.
Tests that change a server's weights put the checkpoint's back (Served.restore_weights) before they end.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass

import pytest
import torch

from megaopd.parallel.dist import find_free_port
from megaopd.serving.sglang_launcher import (
    ServerProcess,
    SGLangLaunchConfig,
    megaopd_serve_command,
    sglang_command,
    sglang_env,
)
from tests.serving.sglang_cases import call

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STUDENT = os.path.join(ROOT, "examples", "tiny", "models", "student")
TEACHER = os.path.join(ROOT, "examples", "tiny", "models", "teacher")
# the teacher of another vocabulary (examples/tiny/tokenizer_xtok, 384 ids): cross-tokenizer OPD (issue 46)
TEACHER_XTOK = os.path.join(ROOT, "examples", "tiny", "models", "teacher_xtok")
STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs")
KV_TOKENS = 16384
"""SGLang's KV cache, in tokens (its CPU default takes ~14 GB of this 24 GB machine)."""


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log softmax of transformers' logits in float64: row t is the distribution that predicts token t + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)


def gap(values, reference) -> float:
    """max |values - reference| (0 for no values)."""
    return float((torch.tensor(values, dtype=torch.float64) - reference).abs().max()) if len(values) else 0.0


@dataclass
class Served:
    """One running server of the tier."""

    kind: str
    """"sglang" or "megaopd" (megaopd serve)."""
    url: str
    hf_dir: str
    process: ServerProcess

    def restore_weights(self) -> None:
        """Loads the checkpoint's weights again (/update_weights_from_disk: both servers speak it), so the
        next test sees the model it expects."""
        status, out = call(
            self.url,
            "POST",
            "/update_weights_from_disk",
            {"model_path": self.hf_dir, "weight_version": "default", "flush_cache": True},
        )
        assert status == 200 and out["success"], (self.kind, status, out)

    def log_tail(self, n_bytes: int = 4000) -> str:
        return self.process.log_tail(n_bytes)


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The SGLang venv's python, installed (or reused) by scripts/install_sglang.sh."""
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "install_sglang.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if r.returncode != 0:
        pytest.fail(f"scripts/install_sglang.sh failed ({r.returncode}):\n{r.stderr[-4000:]}", pytrace=False)
    return os.path.join(r.stdout.strip().splitlines()[-1], "bin", "python")


def _start_sglang(python: str, hf_dir: str, log_dir) -> Served:
    port = find_free_port()
    cfg = SGLangLaunchConfig(
        model_path=hf_dir, port=port, device="cpu", python=python, max_total_tokens=KV_TOKENS, random_seed=0
    )
    # The stand-ins for sgl_kernel and torchvision, and one intra-op thread (a shared 2-core machine).
    env = {**sglang_env(cfg), "PYTHONPATH": STUBS, "OMP_NUM_THREADS": "1"}
    log = str(log_dir / f"sglang-{os.path.basename(hf_dir)}-{port}.log")
    process = ServerProcess.start(
        sglang_command(cfg), url=cfg.url, startup_timeout_s=600, log_path=log, env=env, die_with_parent=True
    )
    return Served("sglang", cfg.url, hf_dir, process)


@pytest.fixture(scope="session")
def sglang_student(sglang_python, tmp_path_factory):
    served = _start_sglang(sglang_python, STUDENT, tmp_path_factory.mktemp("sglang_logs"))
    yield served
    served.process.stop()


@pytest.fixture(scope="session")
def sglang_teacher(sglang_python, tmp_path_factory):
    served = _start_sglang(sglang_python, TEACHER, tmp_path_factory.mktemp("sglang_logs"))
    yield served
    served.process.stop()


@pytest.fixture(scope="session")
def sglang_teacher_xtok(sglang_python, tmp_path_factory):
    served = _start_sglang(sglang_python, TEACHER_XTOK, tmp_path_factory.mktemp("sglang_logs"))
    yield served
    served.process.stop()


@pytest.fixture(scope="session")
def megaopd_student(tmp_path_factory):
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    log = str(tmp_path_factory.mktemp("megaopd_logs") / f"megaopd-serve-{port}.log")
    # --allowed-weight-root: the refusal cases load from fresh pytest folders (tests/serving/sglang_cases.py).
    extra = ["--num-threads", "1", "--allowed-weight-root", str(tmp_path_factory.getbasetemp())]
    process = ServerProcess.start(
        megaopd_serve_command(STUDENT, port, extra_args=extra),
        url=url,
        startup_timeout_s=300,
        log_path=log,
        env={"PYTHONPATH": ROOT},
        die_with_parent=True,
    )
    yield Served("megaopd", url, STUDENT, process)
    process.stop()


@pytest.fixture(scope="session", params=["megaopd", "sglang"])
def server(request) -> Served:
    """The tiny student behind each server in turn: every conformance test runs against both."""
    return request.getfixturevalue(f"{request.param}_student")


@pytest.fixture(scope="session")
def sglang_answer(sglang_student):
    """SGLang's own answer to a request (cached): what both servers' answers are compared with."""
    cache: dict[str, tuple[int, object]] = {}

    def answer(path: str, body) -> tuple[int, object]:
        key = json.dumps([path, body], sort_keys=True)
        if key not in cache:
            cache[key] = call(sglang_student.url, "POST", path, body)
        return cache[key]

    return answer
