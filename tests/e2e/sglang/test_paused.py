"""A server left paused (POST /pause_generation from another process) while the trainer's client asks it to
generate: SGLang 0.5.23's own server and `megaopd serve` (conftest.py) are both named within
rollout.stall_timeout_s, with the fix (issue 53). SGLang's /health answers while paused (after its 20 s
generation check), so the client reads GET /ready there; the server is continued before the test ends."""

from __future__ import annotations

import time

import pytest

from megaopd.rollout.client import EnginePausedError, HttpEngine, HttpEngineConfig
from megaopd.rollout.protocol import SamplingParams
from tests.serving.sglang_cases import call

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

STALL_S = 3.0
MARGIN_S = 3.0


def test_a_paused_server_is_named_within_the_stall_timeout(server):
    engine = HttpEngine(HttpEngineConfig(url=server.url, stall_timeout_s=STALL_S, name="rollout.urls[0]"))
    params = SamplingParams(n=1, max_new_tokens=4, seed=0)
    assert call(server.url, "GET", "/ready")[0] == 200
    assert call(server.url, "POST", "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        assert call(server.url, "GET", "/ready")[0] == 503, server.kind
        t0 = time.monotonic()
        with pytest.raises(EnginePausedError) as e:
            engine.generate([[1, 40, 75]], params)
        took = time.monotonic() - t0
    finally:
        assert call(server.url, "POST", "/continue_generation", {})[0] == 200
    assert STALL_S <= took < STALL_S + MARGIN_S, (server.kind, took)  # was: request_timeout_s (600 s)
    message = str(e.value)
    assert f"engine rollout.urls[0] ({server.url}) is paused" in message and "GET /ready answers 503" in message
    assert f"POST {server.url}/continue_generation" in message
    # Continued: the request held by the pause is served, and the client generates again.
    assert len(engine.generate([[1, 40, 75]], params)) == 1
