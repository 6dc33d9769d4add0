"""A `megaopd serve` left paused (POST /pause_generation by another process) while the trainer's client asks it to
generate: named within stall_timeout_s with the fix, not waited out for request_timeout_s (issue 53). A slow
generation that is going on is not flagged."""

import os
import threading
import time
from dataclasses import dataclass

import pytest

from megaopd.parallel.dist import find_free_port
from megaopd.rollout.client import EnginePausedError, HttpEngine, HttpEngineConfig
from megaopd.rollout.protocol import SamplingParams
from megaopd.serving.sglang_launcher import ServerProcess, megaopd_serve_command
from tests.serving.test_server import get, post

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STALL_S = 2.0
MARGIN_S = 3.0
"""Above stall_timeout_s: a probe's round trip on a loaded 2-core machine (the alternative was 600 s)."""


@dataclass
class Served:
    url: str


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """`megaopd serve` in a process of its own: in this one its decoding would share the client's GIL, and
    the clocks measured here would count that."""
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    log = str(tmp_path_factory.mktemp("serve_log") / "megaopd-serve.log")
    process = ServerProcess.start(
        megaopd_serve_command(tiny_dir, port, extra_args=["--num-threads", "1"]),
        url=url,
        startup_timeout_s=300,
        log_path=log,
        env={"PYTHONPATH": ROOT},
        die_with_parent=True,
    )
    yield Served(url)
    process.stop()


def client(server, stall_s=STALL_S) -> HttpEngine:
    return HttpEngine(HttpEngineConfig(url=server.url, stall_timeout_s=stall_s, name="rollout.urls[0]"))


def test_ready_is_sglangs(server):
    assert get(server.url, "/ready") == (200, "")
    assert post(server.url, "/pause_generation", {"mode": "abort"})[0] == 200
    try:
        assert get(server.url, "/ready") == (503, "")
        assert get(server.url, "/health") == (200, "")  # why /health cannot tell
    finally:
        post(server.url, "/continue_generation", {})
    assert get(server.url, "/ready") == (200, "")


@pytest.mark.parametrize("mode", ["abort", "in_place"])
def test_a_paused_server_is_named_within_the_stall_timeout(server, mode):
    assert post(server.url, "/pause_generation", {"mode": mode})[0] == 200
    engine = client(server)
    try:
        t0 = time.monotonic()
        with pytest.raises(EnginePausedError) as e:
            engine.generate([[1, 2, 3]], SamplingParams(n=1, max_new_tokens=4, seed=0))
        took = time.monotonic() - t0
    finally:
        post(server.url, "/continue_generation", {})
    assert STALL_S <= took < STALL_S + MARGIN_S, took  # was: request_timeout_s (600 s), then an error naming no pause
    message = str(e.value)
    assert f"engine rollout.urls[0] ({server.url}) is paused" in message, message
    assert "GET /ready answers 503" in message and f"POST {server.url}/continue_generation" in message
    # Continued: the same client generates again.
    assert len(engine.generate([[1, 2, 3]], SamplingParams(n=1, max_new_tokens=4, seed=0))) == 1


@pytest.mark.slow
def test_a_slow_generation_is_not_flagged(server):
    """Long responses take several stall timeouts; /ready says the server can generate, so no error. (The
    quick tier's fake servers, tests/rollout/test_stall.py, hold the same rule; this one is a real decode,
    whose probes' round trips reach seconds on a loaded 2-core machine: hence the longer clock.)"""
    stall_s = 4.0
    engine = client(server, stall_s=stall_s)
    params = SamplingParams(n=1, max_new_tokens=500, seed=0, ignore_eos=True)
    # How long a batch decodes depends on the machine's load: grow it until one request outlasts the clock.
    for rows in (64, 256, 1024):
        t0 = time.monotonic()
        samples = engine.generate([[1, 2, 3 + i % 120] for i in range(rows)], params)
        took = time.monotonic() - t0
        assert len(samples) == rows and all(len(s.output_ids) == 500 for s in samples)
        if took > 1.5 * stall_s:
            break
    assert took > stall_s, f"the generation of {rows} rows took {took:.2f} s: too short to show the clock ran"


def test_the_clients_own_pause_is_not_flagged(server):
    """The async weight sync pauses the engine while requests wait: a request sent during the client's own
    pause waits for its continue_generation."""
    engine = client(server)
    engine.pause("in_place")
    threading.Timer(2 * STALL_S, engine.continue_generation).start()
    t0 = time.monotonic()
    assert len(engine.generate([[1, 2, 3]], SamplingParams(n=1, max_new_tokens=4, seed=0))) == 1
    assert time.monotonic() - t0 >= 2 * STALL_S - 0.1
