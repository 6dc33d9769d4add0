"""The launcher: SGLang's command line and environment, quick and clear start failures, servers that die
with the process that started them."""

import sys
import time

import pytest

from megaopd.parallel.dist import find_free_port
from megaopd.serving.sglang_launcher import (
    ServerProcess,
    ServerStartError,
    SGLangLaunchConfig,
    launch_config,
    sglang_command,
    sglang_env,
)


def test_sglang_command_line():
    cfg = SGLangLaunchConfig(
        model_path="/ckpt/hf",
        tp_size=4,
        port=30001,
        host="0.0.0.0",
        mem_fraction_static=0.45,
        enable_memory_saver=True,
        dtype="bfloat16",
        base_gpu_id=4,
        extra_args=["--enable-deterministic-inference"],
        python="python3",
    )
    assert sglang_command(cfg) == [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/ckpt/hf",
        "--tp-size",
        "4",
        "--host",
        "0.0.0.0",
        "--port",
        "30001",
        "--mem-fraction-static",
        "0.45",
        "--enable-memory-saver",
        "--dtype",
        "bfloat16",
        "--base-gpu-id",
        "4",
        "--enable-deterministic-inference",
    ]
    assert cfg.url == "http://127.0.0.1:30001"
    plain = sglang_command(SGLangLaunchConfig(model_path="m", python="py"))
    assert plain == [
        "py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "m",
        "--tp-size",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
    ]
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangLaunchConfig(model_path="m", mem_fraction_static=1.5)
    # SGLang on a CPU (the e2e tier's servers), and seeded rollouts from the config.
    cpu = SGLangLaunchConfig(model_path="m", python="py", device="cpu", max_total_tokens=4096)
    assert sglang_command(cpu)[-14:] == [
        "--max-total-tokens",
        "4096",
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
        "--dtype",
        "float32",
    ]
    assert sglang_env(cpu) == {"SGLANG_USE_CPU_ENGINE": "1"} and sglang_env(cfg) == {}
    from megaopd.rollout.config import RolloutConfig

    seeded = launch_config(
        RolloutConfig(engine="remote", urls=["http://h:1"], deterministic=True, engine_tp=2), "/ckpt/hf", python="py"
    )
    assert "--enable-deterministic-inference" in sglang_command(seeded) and seeded.tp_size == 2
    assert "--enable-deterministic-inference" not in plain
    with pytest.raises(ValueError, match="GPU attention backend"):
        SGLangLaunchConfig(model_path="m", device="cpu", deterministic=True)


def test_launcher_failures_are_quick_and_clear():
    port = find_free_port()
    with pytest.raises(ServerStartError, match="exited with code 3"):
        ServerProcess.start(
            [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
            url=f"http://127.0.0.1:{port}",
            startup_timeout_s=30,
        )
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match="did not answer"):
        ServerProcess.attach(f"http://127.0.0.1:{port}", timeout_s=1.0)
    assert time.monotonic() - t0 < 10


def test_started_server_dies_with_its_parent(tmp_path):
    """die_with_parent: a server started by a process that is SIGKILLed gets SIGTERM (PR_SET_PDEATHSIG), so
    a killed test session leaves no server running."""
    import os
    import signal
    import subprocess

    script = (
        "import subprocess, sys, time\n"
        "from megaopd.serving.sglang_launcher import _term_when_parent_dies\n"
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True, preexec_fn=_term_when_parent_dies)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the child outlived its SIGKILLed parent")
