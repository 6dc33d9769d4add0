"""Start (or attach to) an SGLang server and wait until it answers /health.

    cfg = SGLangLaunchConfig(model_path="/ckpt/hf", tp_size=4, port=30000, mem_fraction_static=0.5,
                             enable_memory_saver=True)            # colocated with the trainer
    with ServerProcess.start(sglang_command(cfg), url=cfg.url, startup_timeout_s=900) as server:
        engine = HttpEngine(server.url)

    server = ServerProcess.attach("http://node7:30000")          # someone else started it

    cfg = SGLangLaunchConfig(model_path=hf_dir, device="cpu", python=venv_python)   # SGLang on a CPU (tests)
    ServerProcess.start(sglang_command(cfg), url=cfg.url, env=sglang_env(cfg))

sglang_command builds `python -m sglang.launch_server ...` and sglang_env its environment; ServerProcess
runs any command that brings up an SGLang-compatible server (SGLang itself, or `megaopd serve`), waits
for GET /health with a deadline, fails early with the log tail when the process exits, and stops the
process group it started (SIGTERM, then SIGKILL) on stop() or exit from the `with` block.

Seeds: SGLang honours sampling_seed only with --enable-deterministic-inference (`deterministic`, from
rollout.deterministic); without it two equal seeded requests may sample differently. That mode needs a
GPU attention backend (FlashInfer, FA3 or Triton) and its batch-invariant kernels cost throughput: SGLang
measured 25-45% slower rollouts (34% on average, its announcement of 2025-09). The embedded engine and
`megaopd serve` reproduce seeded samples without it.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


@dataclass
class SGLangLaunchConfig:
    """Arguments of `python -m sglang.launch_server` that megaopd sets."""

    model_path: str
    """HF model directory (the student's HF export) or hub id."""
    tp_size: int = 1
    """Tensor-parallel GPUs per engine (= its workers in a weight-update group)."""
    port: int = 30000
    host: str = "127.0.0.1"
    """Bind address; 0.0.0.0 when the trainer runs on another node."""
    mem_fraction_static: float | None = None
    """GPU memory fraction for weights + KV cache; leave room for the trainer when colocated."""
    enable_memory_saver: bool = False
    """Needed for /release_memory_occupation (colocated engines give their memory to the trainer)."""
    dtype: str | None = None
    """auto | bfloat16 | float16 | float32; None = SGLang's default (auto)."""
    base_gpu_id: int | None = None
    """First GPU of this engine when several engines share a node."""
    random_seed: int | None = None
    trust_remote_code: bool = False
    deterministic: bool = False
    """--enable-deterministic-inference: sampling_seed reproduces samples (rollout.deterministic; see the
    module docstring for what it costs). GPU attention backends only."""
    device: str = "cuda"
    """cuda, or cpu: SGLang's CPU engine with the flags that run a Qwen2 model there without sgl-kernel's
    CPU build (torch-native attention, PyTorch sampling, no grammar backend, no CUDA graphs, no busy idle
    loop; float32 unless `dtype` says otherwise) and SGLANG_USE_CPU_ENGINE=1 (sglang_env). Used by the CPU
    test tier (tests/e2e/sglang)."""
    max_total_tokens: int | None = None
    """KV-cache size in tokens (--max-total-tokens); None = SGLang's default, which on a CPU takes most of
    the machine's memory."""
    api_key: str | None = field(default=None, repr=False)
    """--api-key: requests but /health* then need `Authorization: Bearer <key>` (megaopd's clients send the
    key from MEGAOPD_API_KEY, or rollout.api_key_env / teacher.api_key_env). Needed to bind anything but
    loopback safely. SGLang takes it on its command line only, so other users of the node can read it in
    the process list; never printed by megaopd."""
    python: str = sys.executable
    extra_args: list[str] = field(default_factory=list)
    """Further flags, passed through verbatim (e.g. ["--enable-deterministic-inference"])."""

    def __post_init__(self):
        if self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size} must be >= 1")
        if not 0 < self.port < 65536:
            raise ValueError(f"port={self.port} must be in 1..65535")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r}: choose cuda or cpu")
        if self.deterministic and self.device == "cpu":
            raise ValueError(
                "deterministic=True needs a GPU attention backend (FlashInfer, FA3 or Triton); "
                "SGLang's CPU engine cannot run --enable-deterministic-inference"
            )

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


def sglang_command(cfg: SGLangLaunchConfig) -> list[str]:
    """The launch_server argv for `cfg`."""
    cmd = [
        cfg.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        cfg.model_path,
        "--tp-size",
        str(cfg.tp_size),
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
    ]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if cfg.dtype is not None:
        cmd += ["--dtype", cfg.dtype]
    if cfg.base_gpu_id is not None:
        cmd += ["--base-gpu-id", str(cfg.base_gpu_id)]
    if cfg.random_seed is not None:
        cmd += ["--random-seed", str(cfg.random_seed)]
    if cfg.trust_remote_code:
        cmd.append("--trust-remote-code")
    if cfg.deterministic:
        cmd.append("--enable-deterministic-inference")
    if cfg.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if cfg.api_key is not None:
        cmd += ["--api-key", cfg.api_key]
    if cfg.device == "cpu":
        # --sleep-on-idle: the scheduler otherwise polls its sockets in a busy loop, a whole CPU core per server.
        cmd += [
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--sampling-backend",
            "pytorch",
            "--grammar-backend",
            "none",
            "--disable-cuda-graph",
            "--sleep-on-idle",
        ]
        if cfg.dtype is None:
            cmd += ["--dtype", "float32"]
    return cmd + list(cfg.extra_args)


def sglang_env(cfg: SGLangLaunchConfig) -> dict[str, str]:
    """Environment variables the server needs beside the caller's (SGLANG_USE_CPU_ENGINE for device cpu)."""
    return {"SGLANG_USE_CPU_ENGINE": "1"} if cfg.device == "cpu" else {}


def launch_config(rollout, model_path: str, **kwargs) -> SGLangLaunchConfig:
    """The launch settings of a rollout engine for a RolloutConfig: its deterministic flag, tp size, memory
    saver (colocated engines) and API key (from the variable rollout.api_key_env names) from the config,
    the rest from kwargs."""
    if "api_key" not in kwargs:
        kwargs["api_key"] = os.environ.get(rollout.api_key_env) or None if rollout.api_key_env else None
    return SGLangLaunchConfig(
        model_path=model_path,
        tp_size=rollout.engine_tp,
        deterministic=rollout.deterministic,
        enable_memory_saver=rollout.colocated,
        **kwargs,
    )


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message holds the log tail."""


def is_healthy(url: str, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ServerProcess:
    """A server this process started (stop() ends it) or attached to (stop() leaves it running)."""

    def __init__(self, url: str, proc: subprocess.Popen | None = None, log_path: str | None = None):
        self.url = url.rstrip("/")
        self.proc = proc
        self.log_path = log_path

    @classmethod
    def attach(cls, url: str, timeout_s: float = 60.0) -> "ServerProcess":
        """Waits for an already running server to answer /health."""
        server = cls(url)
        server.wait_healthy(timeout_s)
        return server

    @classmethod
    def start(
        cls,
        command: list[str],
        url: str,
        startup_timeout_s: float = 900.0,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
        die_with_parent: bool = False,
    ) -> "ServerProcess":
        """Runs `command` in its own process group, logging to `log_path` (a temp file by default).
        die_with_parent (Linux): the server gets SIGTERM when this process dies, even by SIGKILL, so a killed
        test session leaves no server behind (SGLang then stops its own workers)."""
        if is_healthy(url, timeout_s=2.0):
            raise ServerStartError(f"something already answers on {url}; attach to it or pick another port")
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="megaopd-server-", suffix=".log")
            os.close(fd)
        log = open(log_path, "ab")
        try:
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
                preexec_fn=_term_when_parent_dies if die_with_parent else None,
            )
        finally:
            log.close()
        server = cls(url, proc, log_path)
        try:
            server.wait_healthy(startup_timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerStartError(
                    f"server exited with code {self.proc.returncode} before answering "
                    f"{self.url}/health; command: {shlex.join(self.proc.args)}\n{self.log_tail()}"
                )
            if is_healthy(self.url, timeout_s=min(5.0, max(0.1, deadline - time.monotonic()))):
                return
            time.sleep(0.25)
        raise ServerStartError(f"{self.url}/health did not answer 200 within {timeout_s:.0f}s\n{self.log_tail()}")

    def log_tail(self, n_bytes: int = 4000) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - n_bytes))
            return f.read().decode(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ends a server this process started (its whole process group: SGLang spawns workers)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _term_when_parent_dies() -> None:
    """In the child before exec: prctl(PR_SET_PDEATHSIG, SIGTERM)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def megaopd_serve_command(
    hf_dir: str, port: int, host: str = "127.0.0.1", extra_args: list[str] | None = None, python: str = sys.executable
) -> list[str]:
    """The same kind of command for the embedded server (CPU stand-in for SGLang). Its key travels in the
    environment, not the command line: ServerProcess.start(..., env={"MEGAOPD_API_KEY": key})."""
    return [
        python,
        "-m",
        "megaopd.cli",
        "serve",
        "--hf-dir",
        hf_dir,
        "--port",
        str(port),
        "--host",
        host,
        *(extra_args or []),
    ]
