"""The client's waits against real sockets: a server that accepts and never answers is a stall, named in one
error within stall_timeout_s (not retried); one that answers but is paused by someone else while a /generate
waits is named as paused; one that is slow but can generate is not; a stop request (the trainer's preemption
flag) gives any wait up at once. tests/serving/test_paused.py does the pause against a real `megaopd serve`."""

import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megaopd.rollout.client import EnginePausedError, EngineStalledError, HttpEngine, HttpEngineConfig
from megaopd.rollout.pool import EnginePool, PoolError
from megaopd.rollout.protocol import SamplingParams
from megaopd.rollout.waits import WaitAbandoned


class SilentServer:
    """Accepts connections and reads nothing, answers nothing: what a SIGSTOPped server looks like from outside
    (the kernel completes the handshake; no byte ever comes back)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.held, self.closed = [], False
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self):
        self.closed = True
        for c in self.held:
            c.close()
        self.sock.close()


@pytest.fixture
def silent():
    server = SilentServer()
    yield server
    server.close()


def test_a_silent_engine_is_one_stall_error_within_the_timeout(silent):
    engine = HttpEngine(HttpEngineConfig(url=silent.url, stall_timeout_s=1.0, retries=3, name="rollout.urls[0]"))
    t0 = time.monotonic()
    with pytest.raises(EngineStalledError) as e:
        engine.request("POST", "/generate", {"input_ids": [[1, 2]]}, timeout_s=600)
    took = time.monotonic() - t0
    assert 1.0 <= took < 1.6, took  # not the 600 s socket timeout, and not retried 3 times
    message = str(e.value)
    assert "rollout.urls[0]" in message and silent.url in message and "stall_timeout_s" in message
    # The cleanup that follows a stall does not wait out a second one: one short /health recheck.
    t0 = time.monotonic()
    with pytest.raises(EngineStalledError, match="has not answered since it stalled"):
        engine.request("POST", "/end_weight_update", {})
    assert time.monotonic() - t0 < 1.5


def test_the_pool_names_the_stalled_engine(silent):
    pool = EnginePool([HttpEngine(HttpEngineConfig(url=silent.url, stall_timeout_s=0.5, name="rollout.urls[0]"))])
    t0 = time.monotonic()
    with pytest.raises(PoolError, match=r"engine rollout.urls\[0\] \(http://127.0.0.1:\d+\) made no progress"):
        pool.generate([[1, 2, 3]], SamplingParams(n=1, max_new_tokens=4, seed=0))
    assert time.monotonic() - t0 < 1.5


def test_a_stop_request_abandons_the_wait_at_once(silent):
    stop = threading.Event()
    engine = HttpEngine(HttpEngineConfig(url=silent.url, stall_timeout_s=0), stop=stop.is_set)  # no stall clock
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(WaitAbandoned):
        engine.request("POST", "/generate", {"input_ids": [[1]]}, timeout_s=600)
    assert time.monotonic() - t0 < 0.6
    before = len(silent.held)
    with pytest.raises(WaitAbandoned):  # after the stop nothing is sent
        engine.request("GET", "/model_info")
    time.sleep(0.1)
    assert len(silent.held) == before


class _SlowHandler(BaseHTTPRequestHandler):
    """A POST answers after `delay` s (pause and continue at once); a GET answers `gets[path]` at once (404 for
    a path not in it)."""

    delay, gets = 1.8, {"/health": 200, "/ready": 200, "/health_generate": 200}

    def do_GET(self):
        self.send_response(self.gets.get(self.path, 404))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path not in ("/pause_generation", "/continue_generation"):
            time.sleep(self.delay)
        body = json.dumps({"ok": True}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def fake_server(**gets):
    """A _SlowHandler server whose GETs answer `gets` (path without its slash -> status; None: 404)."""
    answers = {f"/{k}": v for k, v in gets.items() if v is not None}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_SlowHandler,), {"gets": answers}))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize(
    "gets",
    [
        dict(health=200, ready=200, health_generate=200),  # SGLang 0.5.23, megaopd serve: ready
        dict(health=200, ready=None, health_generate=200),  # an older SGLang without /ready: it generates
        dict(health=200, ready=503, health_generate=200),  # a stale "unhealthy" flag: it generates after all
    ],
)
def test_a_slow_engine_that_can_generate_is_not_a_stall(gets):
    """A long /generate says nothing until it is done; an engine that says it can generate keeps the clock
    from running out."""
    with fake_server(**gets) as url:
        engine = HttpEngine(HttpEngineConfig(url=url, stall_timeout_s=0.6))
        assert engine.request("POST", "/generate", {"input_ids": [[1]]}) == {"ok": True}


@pytest.mark.parametrize(
    "gets, named",
    [
        (dict(health=200, ready=503, health_generate=503), "GET /ready answers 503"),
        (dict(health=200, ready=None, health_generate=503), "GET /health_generate answers 503"),
    ],
)
def test_an_engine_paused_by_someone_else_is_named_within_the_stall_timeout(gets, named):
    """/health answers 200 while SGLang (or megaopd serve) is paused: the client reads /ready (and
    /health_generate) while a /generate waits, and names the pause and its fix instead of waiting out the
    request's timeout."""
    with fake_server(**gets) as url:
        engine = HttpEngine(HttpEngineConfig(url=url, stall_timeout_s=0.6, name="rollout.urls[0]"))
        t0 = time.monotonic()
        with pytest.raises(EnginePausedError) as e:
            engine.request("POST", "/generate", {"input_ids": [[1]]}, timeout_s=600)
        assert 0.6 <= time.monotonic() - t0 < 1.2
        message = str(e.value)
        assert f"rollout.urls[0] ({url}) is paused" in message and named in message
        assert f"POST {url}/continue_generation" in message and "stall_timeout_s=0.6" in message


def test_the_clients_own_pause_is_not_a_stall():
    """The trainer pauses the engines for an async weight sync while requests wait: its own pause is expected."""
    with fake_server(health=200, ready=503, health_generate=503) as url:
        engine = HttpEngine(HttpEngineConfig(url=url, stall_timeout_s=0.6))
        engine.pause("in_place")
        assert engine.request("POST", "/generate", {"input_ids": [[1]]}) == {"ok": True}
        engine.continue_generation()
        with pytest.raises(EnginePausedError):  # now the 503 is somebody else's pause
            engine.request("POST", "/generate", {"input_ids": [[1]]})


def test_other_requests_count_any_answer():
    """A weight update on a paused engine is no stall (SGLang updates paused engines at once): only a /generate
    needs the engine to generate."""
    with fake_server(health=200, ready=503, health_generate=503) as url:
        engine = HttpEngine(HttpEngineConfig(url=url, stall_timeout_s=0.6))
        assert engine.request("POST", "/update_weights_from_disk", {}) == {"ok": True}


def test_a_silent_teacher_server_is_named(silent):
    import torch

    from megaopd.scoring.remote import RemoteTeacher, RemoteTeacherError, ServerPolicy

    teacher = RemoteTeacher("math", [silent.url], ServerPolicy(stall_timeout_s=0.5, retries=3))
    t0 = time.monotonic()
    with pytest.raises(RemoteTeacherError, match=r"engine teacher 'math' urls\[0\] .* made no progress"):
        teacher.score(torch.tensor([[1, 2, 3, 4]]), torch.tensor([2]), torch.tensor([2]))
    assert time.monotonic() - t0 < 1.5


def test_a_stop_ends_a_pool_wait_without_trying_the_other_engines(silent):
    stop = threading.Event()
    engines = [HttpEngine(HttpEngineConfig(url=silent.url, stall_timeout_s=0), stop=stop.is_set) for _ in range(2)]
    pool = EnginePool(engines)
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(WaitAbandoned):
        pool.generate([[1], [2]], SamplingParams(n=1, max_new_tokens=4, seed=0))
    assert not pool.failed  # abandoned is not failed: no engine is marked


def test_the_weight_update_group_does_not_wait_for_a_silent_engine(silent):
    from megaopd.sync.distributed import DistributedUpdateConfig, DistributedWeightUpdater

    updater = DistributedWeightUpdater(
        [HttpEngine(HttpEngineConfig(url=silent.url, stall_timeout_s=1.0))],
        DistributedUpdateConfig(backend="gloo", timeout_s=600),
    )
    t0 = time.monotonic()
    with pytest.raises(EngineStalledError, match="made no progress|has not answered since it stalled"):
        updater.connect()  # was: the rendezvous' and the POST's 600 s
    assert time.monotonic() - t0 < 5.0
