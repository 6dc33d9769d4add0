"""HTTP client of one rollout server (`megaopd serve` or a real SGLang server).

    engine = HttpEngine(HttpEngineConfig(url="http://127.0.0.1:30000"))
    samples = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=512, seed=step))

Every request has a timeout; connection failures, timeouts and 5xx answers are retried with
exponential backoff, 4xx answers are not (they are the caller's bug) and raise EngineRequestError
with the server's message. No request waits blind (megaopd.rollout.waits): an engine that answers neither
the request nor GET /health for `stall_timeout_s` raises EngineStalledError at once, without retries; so
does one that answers but is paused while a /generate waits (EnginePausedError: GET /ready answers 503, as
SGLang 0.5.23 and `megaopd serve` do while paused, unless this client paused it itself). The `stop`
callback (the trainer's preemption flag) gives any wait up within a fraction of a second (WaitAbandoned).
Every sampling parameter is sent explicitly (servers fill omitted ones from generation_config.json). A
prompt's n samples are sent as n batch entries with n=1 and their own sampling_seed (protocol.expand_samples),
so results are prompt-major and independent of how the server orders an n > 1 request.

Seeds: on `megaopd serve` a seeded call gives the same samples every time, equal to the embedded engine's.
SGLang honours sampling_seed only when launched with --enable-deterministic-inference (rollout.deterministic;
GPU attention backends, 25-45% slower rollouts); without it two equal seeded calls can differ.

Weights reach the server through megaopd.sync (weight_transports: a torch.distributed group, or CUDA IPC
handles when colocated); this client only carries the HTTP side of them: the server's version, and the
weight-update session that SGLang 0.5.2x demands around every update (begin_weight_update /
end_weight_update; older servers have neither endpoint and need none).

Memory: the client remembers which tags it released and refuses to resume any other (SGLang 0.5.23
kills the server when asked to resume a tag that was never released).

Key: every request carries `Authorization: Bearer <key>` when the config's variable (api_key_env, by
default MEGAOPD_API_KEY) holds one, as SGLang's --api-key and `megaopd serve` expect. Never printed.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

from megaopd.engine.memory import check_resume, memory_tags
from megaopd.rollout import waits
from megaopd.rollout.protocol import Sample, SamplingParams, expand_samples
from megaopd.rollout.schema import (
    WEIGHT_UPDATE_SESSION_SINCE,
    PrefillScores,
    params_to_json,
    parse_version,
    prefill_request,
    prefill_scores_list,
    sample_from_json,
)


class EngineError(RuntimeError):
    """A rollout server failed a request; the message names the server, the endpoint and why."""


class EngineRequestError(EngineError):
    """The server rejected the request (HTTP 4xx): retrying will not help."""

    def __init__(self, message: str, status: int, body: Any):
        super().__init__(message)
        self.status, self.body = status, body


class EngineUnavailableError(EngineError):
    """No answer (connection refused/reset, timeout, 5xx) after all retries: the engine is down or stuck."""


class EngineStalledError(EngineUnavailableError):
    """The engine answered nothing, neither the request nor GET /health, for stall_timeout_s (stopped, hung or
    unreachable); raised at once, not retried."""


class EnginePausedError(EngineStalledError):
    """A /generate waited stall_timeout_s on an engine that answers but generates nothing: paused by another
    process (GET /ready: 503) or not generating (GET /health_generate: 503). Raised at once, not retried."""


_PROGRESS_PATHS = ("/generate",)
"""Requests that need the engine to generate: while one waits, an engine that answers but is paused (by someone
other than this client) is no progress. For the others (weight updates, control) any answer is."""

_RECHECK_S = 2.0
"""After a stall, how long the engine has to answer GET /health before another request is sent to it (else
that request fails at once: the cleanups that follow a stall must not each wait out another stall)."""


@dataclass
class HttpEngineConfig:
    """How to reach one server."""

    url: str
    """Base URL, e.g. http://127.0.0.1:30000."""
    generate_timeout_s: float = 1800.0
    """Longest wait for one /generate answer (a whole batch of long responses)."""
    control_timeout_s: float = 60.0
    """Longest wait for a control request (health, flush, pause, memory, model info)."""
    retries: int = 3
    """Extra attempts after a connection error, timeout or 5xx (0: fail at once)."""
    backoff_s: float = 0.5
    """First wait before a retry; doubles each attempt up to max_backoff_s."""
    max_backoff_s: float = 8.0
    max_entries_per_request: int = 1024
    """Batch entries (samples) per /generate request; larger batches are split into several requests."""
    workers: int = 1
    """Processes of this engine in a weight-update group (its tensor-parallel size)."""
    base_gpu_id: int = 0
    """First GPU (local index on its node) of this engine: with colocated engines, the trainer rank on
    GPU base_gpu_id + r hands engine TP rank r its tensors by CUDA IPC."""
    api_key_env: str = "MEGAOPD_API_KEY"
    """Environment variable holding the server's API key, read once here ("" or unset: no key)."""
    api_key: str | None = field(default=None, repr=False)
    """The key itself; None: read it from api_key_env. Kept out of repr (never logged)."""
    stall_timeout_s: float = 30.0
    """Longest time without progress while a request waits: no answer to the request nor a probe that says the
    engine can make progress, which the client asks every stall_timeout_s / 3 (at most every 5 s) while the
    request is outstanding. For a /generate the probe is GET /ready (200: ready; 503: paused or unhealthy,
    then GET /health_generate decides; a server without /ready: GET /health_generate alone), unless this
    client paused the engine itself; for other requests any answer to GET /health counts. Then
    EngineStalledError (EnginePausedError when the engine answered but was paused), not retried. 0: no stall
    clock (only the timeouts above). The trainer sets it from rollout.stall_timeout_s."""
    name: str = ""
    """How errors name the engine besides its URL: its config key, e.g. rollout.urls[1]."""
    vocab_size: int = 0
    """The student's vocabulary: generated ids outside [0, vocab_size) are refused where the answer is parsed
    (schema.sample_from_json), naming this engine. 0: not checked."""

    def __post_init__(self):
        self.url = self.url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url={self.url!r} must start with http:// or https://")
        if self.retries < 0 or self.backoff_s < 0:
            raise ValueError("retries and backoff_s must be >= 0")
        if self.stall_timeout_s < 0:
            raise ValueError(f"stall_timeout_s={self.stall_timeout_s} must be >= 0 (0: no stall clock)")
        if self.workers < 1:
            raise ValueError(f"workers={self.workers} must be >= 1 (the server's tp size)")
        if self.api_key is None and self.api_key_env:
            self.api_key = os.environ.get(self.api_key_env) or None


class HttpEngine:
    """The Engine protocol over HTTP against one SGLang-compatible server."""

    @property
    def weight_transports(self) -> tuple[str, ...]:
        """A weight-update group (engines on their own GPUs), or CUDA IPC handles (colocated engines); and, from
        `megaopd serve` (its server info says so; asked once), the group with LoRA adapters alone through
        /load_lora_adapter (http_lora). SGLang 0.5.23's LoRA routes need a GPU on this build (docs/engines.md)."""
        if self._megaopd_serve is None:
            info = self.server_info()
            self._megaopd_serve = isinstance(info, dict) and info.get("megaopd_serve") is True
        return ("dist_group", "cuda_ipc", "http_lora") if self._megaopd_serve else ("dist_group", "cuda_ipc")

    def __init__(self, config: HttpEngineConfig | str, stop: Callable[[], bool] | None = None):
        """stop: true once every wait on this engine should be given up (the trainer's PreemptionFlag.signalled):
        requests then raise WaitAbandoned instead of waiting or being sent."""
        self.config = HttpEngineConfig(url=config) if isinstance(config, str) else config
        self.stop = stop
        self._stalled = False  # the last request stalled, and nothing was heard from the engine since
        self._holding = False  # this client paused the engine (pause() .. continue_generation()): not a stall
        self._has_ready: bool | None = None  # whether the server answers GET /ready (None: not asked yet)
        self._held_at: tuple[float, str] | None = None  # when a probe last saw it answer but not generate, what
        self._released: set[str] = set()
        self._version: tuple[int, int, int] | None | str = "unknown"  # cached server version
        self._session_endpoints = True  # False once the server answered 404 to /begin_weight_update
        self._megaopd_serve: bool | None = None  # whether the server is `megaopd serve` (asked once)

    @property
    def url(self) -> str:
        return self.config.url

    def __repr__(self) -> str:
        return f"HttpEngine({self.url})"

    # ------------------------------------------------------------------------------- transport
    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout_s: float | None = None,
        retries: int | None = None,
        parse: bool = True,
    ) -> Any:
        """One call with retries; returns the parsed JSON (or text). Raises EngineRequestError on 4xx,
        EngineUnavailableError when every attempt failed to get an answer, EngineStalledError (no retry) when
        the engine fell silent for stall_timeout_s, WaitAbandoned once stop() is true."""
        timeout_s = self.config.control_timeout_s if timeout_s is None else timeout_s
        retries = self.config.retries if retries is None else retries
        data = None if body is None else json.dumps(body).encode()
        delay = self.config.backoff_s
        what = f"{method} {self.url}{path}"
        last = ""
        for attempt in range(retries + 1):
            try:
                status, raw = self._answer(method, path, data, timeout_s)
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            else:
                if status < 400:
                    return _decode(raw) if parse else raw.decode(errors="replace")
                payload = _decode(raw)
                if status < 500:
                    raise EngineRequestError(
                        f"{what} -> HTTP {status}: {_message(payload)}" + _auth_hint(status, self.config),
                        status,
                        payload,
                    )
                last = f"HTTP {status}: {_message(payload)}"
            if attempt < retries:
                waits.sleep(delay, self.stop, what)
                delay = min(delay * 2, self.config.max_backoff_s)
        raise EngineUnavailableError(f"{what} failed after {retries + 1} attempt(s): {last}")

    def _answer(self, method: str, path: str, data: bytes | None, timeout_s: float) -> tuple[int, bytes]:
        """One attempt: the HTTP status and body (4xx/5xx included), waited for in slices (megaopd.rollout.waits)."""
        what = f"{method} {self.url}{path}"

        def attempt() -> tuple[int, bytes]:
            req = urllib.request.Request(self.url + path, data=data, method=method, headers=self._headers(data))
            try:
                with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                    return resp.status, resp.read()
            except urllib.error.HTTPError as e:
                return e.code, e.read()

        if self._stalled:  # a cleanup after a stall: ask once, briefly, whether the engine is back
            waits.check_stop(self.stop, what)
            try:
                self._probe(min(_RECHECK_S, self.config.stall_timeout_s or _RECHECK_S))
            except Exception:  # noqa: BLE001 - still silent
                raise EngineStalledError(
                    f"{what}: {self.label} has not answered since it stalled "
                    f"(GET /health: no answer in {_RECHECK_S:.0f} s)"
                ) from None
            self._stalled = False
        generating = path in _PROGRESS_PATHS
        started = time.monotonic()
        try:
            out = waits.wait(
                attempt,
                what,
                self.stop,
                self.config.stall_timeout_s,
                self._makes_progress if generating else self._answers,
            )
        except waits.Silence as s:
            held = self._held_at[1] if self._held_at and self._held_at[0] >= started else None
            if generating and held:
                raise EnginePausedError(self._paused_message(method, path, s.seconds, held)) from None
            self._stalled = True
            probe = "/ready" if generating and self._has_ready is not False else "/health"
            raise EngineStalledError(self._stall_message(method, path, s.seconds, probe)) from None
        return out

    def _status(self, path: str, timeout_s: float | None = None) -> int:
        """GET `path`'s HTTP status (any: 4xx/5xx too); raises when the engine does not answer."""
        timeout_s = timeout_s or self.config.stall_timeout_s or self.config.control_timeout_s
        try:
            with urllib.request.urlopen(
                urllib.request.Request(self.url + path, headers=self._headers(None)), timeout=timeout_s
            ) as resp:
                resp.read()
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code

    def _probe(self, timeout_s: float | None = None) -> None:
        """GET /health: returns on any answer (a 503 too: the process is alive), raises on none."""
        self._status("/health", timeout_s)

    def _answers(self) -> bool:
        """The stall clock's probe for requests that need no generation: any answer is progress."""
        self._probe()
        return True

    def _makes_progress(self) -> bool:
        """The stall clock's probe while a /generate waits: True when the engine can generate, False when it
        answers but cannot (paused by another process, or not generating; recorded in _held_at for the
        message), raises when it does not answer. While this client holds its own pause, any answer counts.

        GET /ready first (SGLang 0.5.23 and `megaopd serve`: 503 while paused or unhealthy, a flag read at
        once); on 503, GET /health_generate decides (200: it generates after all: SGLang's health flag was
        stale, and that check resets it; 503: nothing was generated in its window, about 20 s). A server
        without /ready (older SGLang; 404, or 401 where only /health* is open) gets /health_generate alone."""
        if self._holding:
            return self._answers()
        try:
            held = self._held()
        except Exception:
            self._held_at = None  # no answer now: silent, whatever an earlier probe saw
            raise
        if held and not self._holding:
            self._held_at = (time.monotonic(), held)
            return False
        self._held_at = None
        return True

    def _held(self) -> str | None:
        """What says the engine answers but cannot generate (None: it can); raises when it does not answer."""
        if self._has_ready is not False:
            status = self._status("/ready")
            if status == 200:
                self._has_ready = True
                return None
            self._has_ready = status == 503
            if self._has_ready:
                self._held_at = (time.monotonic(), "GET /ready answers 503")  # named while the next check waits
        status = self._status("/health_generate", max(self.config.stall_timeout_s, 30.0))
        if status != 503:
            return None
        return "GET /ready answers 503" if self._has_ready else "GET /health_generate answers 503 (no token generated)"

    @property
    def label(self) -> str:
        """The engine as errors name it: its config key (when known) and URL."""
        return f"engine {self.config.name} ({self.url})" if self.config.name else f"engine {self.url}"

    def _stall_message(self, method: str, path: str, seconds: float, probe: str = "/health") -> str:
        return (
            f"{self.label} made no progress for {seconds:.0f} s (stall_timeout_s={self.config.stall_timeout_s:g}): "
            f"no answer to {method} {path} nor to GET {probe}. It is stopped (SIGSTOP), hung or unreachable: "
            "check that server's process and log, and the network to it; raise rollout.stall_timeout_s only "
            "if it is alive but answers /health that slowly"
        )

    def _paused_message(self, method: str, path: str, seconds: float, held: str) -> str:
        return (
            f"{self.label} is paused or generates nothing: {held} while {method} {path} waited {seconds:.0f} s "
            f"(stall_timeout_s={self.config.stall_timeout_s:g}), and this trainer did not pause it. Another "
            f"process paused it (POST /pause_generation with no /continue_generation since): POST "
            f"{self.url}/continue_generation, or stop what paused it; if it is not paused, it is unhealthy: see "
            "that server's log"
        )

    def _headers(self, data: bytes | None) -> dict[str, str]:
        """Every request's headers: the JSON body's type, and the key (SGLang's --api-key scheme)."""
        headers = {"Content-Type": "application/json"} if data else {}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    # ------------------------------------------------------------------------------- Engine protocol
    def generate(self, prompts: list[list[int]], params: SamplingParams, first_prompt_index: int = 0) -> list[Sample]:
        entries = [
            (r.prompt_ids, params_to_json(params, r.seed))
            for r in expand_samples(prompts, params.n, params.seed, first_prompt_index)
        ]
        samples: list[Sample] = []
        step = self.config.max_entries_per_request
        for start in range(0, len(entries), step):
            chunk = entries[start : start + step]
            body = {
                "input_ids": [p for p, _ in chunk],
                "sampling_params": [sp for _, sp in chunk],
                "return_logprob": True,
                "logprob_start_len": -1,
                "stream": False,
            }
            prompts = [p for p, _ in chunk]
            samples += self._post_generate(
                body,
                len(prompts),
                "",
                lambda out, ps=prompts: [sample_from_json(p, e, self.config.vocab_size) for p, e in zip(ps, out)],
            )
        return samples

    def _post_generate(self, body: dict, n: int, what: str, parse: Callable[[list], list]) -> list:
        """POST /generate and parse(answer) of its answer, one entry per item asked (n); EngineError when the
        answer is not a list of that many (`what` names them in the message) or parse refuses an entry
        (ValueError: numbers from outside are refused where they enter)."""
        out = self.request("POST", "/generate", body, timeout_s=self.config.generate_timeout_s)
        if not isinstance(out, list) or len(out) != n:
            raise EngineError(
                f"{self.url}/generate answered {type(out).__name__} of "
                f"{len(out) if isinstance(out, list) else 1} entries for {n}{what}"
            )
        try:
            return parse(out)
        except ValueError as e:
            who = f" ({self.config.name})" if self.config.name else ""
            raise EngineError(f"{self.url}/generate{who}: {e}") from e

    def weight_targets(self) -> list["HttpEngine"]:
        return [self]

    @property
    def released_tags(self) -> frozenset[str]:
        """Tags this client released and has not resumed since (what it may resume)."""
        return frozenset(self._released)

    def release_memory(self, tags: list[str] | None = None) -> None:
        wanted = memory_tags(tags, f"{self.url} release_memory")
        self.request("POST", "/release_memory_occupation", {"tags": tags})
        self._released.update(wanted)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Resumes released tags; MemoryStateError, before any request, for a tag this client did not release."""
        wanted = check_resume(tags, self._released, f"{self.url} resume_memory")
        self.request("POST", "/resume_memory_occupation", {"tags": tags})
        self._released.difference_update(wanted)

    # ------------------------------------------------------------------------------- weight updates
    def server_info(self) -> dict:
        """GET /server_info (newer SGLang), else /get_server_info."""
        try:
            return self.request("GET", "/server_info")
        except EngineRequestError as e:
            if e.status not in (404, 405):
                raise
            return self.request("GET", "/get_server_info")

    def server_version(self) -> tuple[int, int, int] | None:
        """The server's SGLang version from its server info (cached); None when it names none."""
        if self._version == "unknown":
            info = self.server_info()
            self._version = parse_version(info.get("version")) if isinstance(info, dict) else None
        return self._version

    def begin_weight_update(self, selector: str = "all") -> bool:
        """Opens SGLang's weight-update session where the server needs one; True when one was opened.

        Servers older than WEIGHT_UPDATE_SESSION_SINCE are not asked; a newer one without the endpoint
        (404) is remembered as needing none. Any other refusal (a session already open) raises.
        """
        version = self.server_version()
        if not self._session_endpoints or (version is not None and version < WEIGHT_UPDATE_SESSION_SINCE):
            return False
        try:
            self.request("POST", "/begin_weight_update", {"selector": selector}, retries=0)
        except EngineRequestError as e:
            if e.status != 404:
                raise
            self._session_endpoints = False
            return False
        return True

    def end_weight_update(self) -> None:
        """Closes the session begin_weight_update opened (call it only when that returned True)."""
        self.request("POST", "/end_weight_update", {}, retries=0)

    def health(self) -> bool:
        """GET /health answered 200 (after a stall too: this is how a stalled engine comes back)."""
        self._stalled = False
        try:
            self.request("GET", "/health", retries=0, parse=False)
            return True
        except EngineError:
            return False

    # ------------------------------------------------------------------------------- extras
    def score_prefill(self, seqs: list[list[int]], firsts: list[int], topk: int = 0) -> list[PrefillScores]:
        """Each sequence's log-probs of its tokens from firsts[i] on (and the top-`topk` of each distribution),
        by prefill alone at temperature 1, in one /generate request (schema.prefill_request says how).
        EngineRequestError when the server refuses it, EngineError when the answer is malformed."""
        return self._post_generate(
            prefill_request(seqs, firsts, topk),
            len(seqs),
            " sequences",
            lambda out: prefill_scores_list(out, seqs, firsts, topk),  # a bad score names the row
        )

    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        """log softmax(logits) (temperature 1) of each prompt token given its prefix; None for the first,
        which has no prefix (the embedded engine's prompt_logprobs; the parity probe reads it)."""
        return [None] + self.score_prefill([list(prompt_ids)], [1])[0].logprobs

    def health_generate(self) -> bool:
        try:
            self.request("GET", "/health_generate", retries=0, parse=False)
            return True
        except EngineError:
            return False

    def flush_cache(self, timeout_s: float = 60.0) -> None:
        """Flushes the prefix cache; SGLang refuses while requests run, so this retries until it succeeds."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.request("POST", "/flush_cache", parse=False)
                return
            except EngineRequestError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def pause(self, mode: str = "abort") -> None:
        """Pauses generation (a weight sync's): until continue_generation, requests waiting on the engine are
        not flagged as paused by the stall clock (the pause is this client's own)."""
        self._holding = True  # before the request: a probe answered just after the pause must see it
        try:
            self.request("POST", "/pause_generation", {"mode": mode})
        except BaseException:
            self._holding = False
            raise

    def continue_generation(self) -> None:
        try:
            self.request("POST", "/continue_generation", {})
        finally:
            self._holding = False  # a pause that outlives a failed continue is named like anyone else's

    def model_info(self) -> dict:
        try:
            return self.request("GET", "/get_model_info")
        except EngineRequestError:  # newer SGLang renamed it
            return self.request("GET", "/model_info")

    def weight_version(self) -> str | None:
        return self.model_info().get("weight_version")

    def close(self) -> None:
        """Nothing to release: connections are per request (kept for the pool's close())."""


def _decode(raw: bytes) -> Any:
    text = raw.decode(errors="replace")
    try:
        return json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return text


def _auth_hint(status: int, config: HttpEngineConfig) -> str:
    """What to do about a 401: where the key comes from, and whether one was sent."""
    if status != 401:
        return ""
    var = f"${config.api_key_env}" if config.api_key_env else "HttpEngineConfig.api_key"
    if config.api_key:
        return f" (the key in {var} is not the server's --api-key)"
    return (
        f" (the server wants an API key: set {var} to its --api-key; rollout.api_key_env / "
        "teacher.api_key_env name the variable)"
    )


def _message(payload: Any) -> str:
    if isinstance(payload, dict):
        if isinstance(payload.get("error"), dict):
            return str(payload["error"].get("message"))
        for key in ("message", "detail"):
            if key in payload:
                return str(payload[key])
    return str(payload)[:2000]
