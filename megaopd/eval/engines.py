"""The engines `megaopd eval --engines URL[,URL...]` evaluates on: running SGLang servers (or `megaopd
serve`), through the same EnginePool the trainer's rollouts use (work spread over the servers, results
in input order, a failed job retried on another server).

    pool = engine_pool("http://node1:30000,http://node1:30010", timeout_s=7200)
    evaluate(EvalModel(pool, tokenizer), ["aime24"], EvalConfig(batch_size=256 * len(pool.engines)))
"""

from __future__ import annotations

import time

from megaopd.rollout.client import HttpEngine, HttpEngineConfig
from megaopd.rollout.pool import EnginePool, PoolConfig


def parse_urls(spec: str) -> list[str]:
    """ "URL[,URL...]" -> URLs; raises ValueError naming the bad one."""
    urls = [u.strip().rstrip("/") for u in spec.split(",") if u.strip()]
    if not urls:
        raise ValueError("--engines is empty: give URL[,URL...], e.g. http://127.0.0.1:30000")
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"--engines: {u!r} is not a URL; write it as http://HOST:PORT")
    if len(set(urls)) != len(urls):
        raise ValueError(f"--engines lists a server twice: {spec}")
    return urls


def engine_pool(
    spec: str | list[str], timeout_s: float = 6 * 3600.0, request_timeout_s: float = 3600.0, wait_s: float = 30.0
) -> EnginePool:
    """An EnginePool over HttpEngines at the URLs. timeout_s bounds one generate call of the pool,
    request_timeout_s one /generate request to one server (a batch of long responses). Waits up to wait_s
    for every server's /health (a server still loading its model answers 503), then raises RuntimeError
    listing those that do not answer."""
    urls = parse_urls(spec) if isinstance(spec, str) else list(spec)
    engines = [HttpEngine(HttpEngineConfig(url=u, generate_timeout_s=request_timeout_s)) for u in urls]
    deadline = time.monotonic() + wait_s
    down = [e for e in engines if not e.health()]
    while down and time.monotonic() < deadline:
        time.sleep(0.5)
        down = [e for e in down if not e.health()]
    if down:
        raise RuntimeError(
            f"engine(s) not answering {', '.join(e.url + '/health' for e in down)} after "
            f"{wait_s:.0f}s: start them (python -m sglang.launch_server ... or megaopd serve) "
            "or fix --engines"
        )
    return EnginePool(engines, PoolConfig(timeout_s=timeout_s))
