"""HTTP client of one rollout server (`megaopd serve` or a real SGLang server), and the trainer side of
the distributed weight update.

    engine = HttpEngine(HttpEngineConfig(url="http://127.0.0.1:30000"))
    samples = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=512, seed=step))

    updater = DistributedWeightUpdater([engine], DistributedUpdateConfig(master_address="10.0.0.1"))
    updater.connect()                                   # POST /init_weights_update_group from threads,
                                                        # while this process joins as rank 0
    updater.update(hf_named_tensors, weight_version="step-7")   # per bucket: POST the metadata to every
                                                        # engine, broadcast, wait for their answers
    updater.close()

Every request has a timeout; connection failures, timeouts and 5xx answers are retried with
exponential backoff, 4xx answers are not (they are the caller's bug) and raise EngineRequestError
with the server's message. Every sampling parameter is sent explicitly (servers fill omitted ones from
generation_config.json). A prompt's n samples are sent as n batch entries with n=1 and their own
sampling_seed (derive_seed), so results are prompt-major, independent of how the server orders an
n > 1 request, and identical to the embedded engine's for the same seed.

The weight update follows SGLang's /update_weights_from_distributed: the trainer is rank 0 of a
group of 1 + (the engines' workers); per bucket one POST carries names/dtypes/shapes and then either
one broadcast per tensor (load_format None, the gloo default) or one broadcast of the bucket's bytes
("flattened_bucket", the nccl default; megaopd.rollout.dist_group). Tensors are consumed lazily, a
bucket ahead. An engine that received a bucket but refused to load it (names/shapes: it lists them)
leaves the group in step: the other buckets still go and one error lists every refusal at the end.
An engine that refused before receiving, closed the group or stopped answering raises at once
instead of leaving the trainer blocked in a broadcast; the group is then abandoned and connect()
forms a new one (under a fresh group name).
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from megaopd.rollout import dist_group
from megaopd.rollout.protocol import Sample, SamplingParams, derive_seed
from megaopd.rollout.schema import params_to_json, sample_from_json


class EngineError(RuntimeError):
    """A rollout server failed a request; the message names the server, the endpoint and why."""


class EngineRequestError(EngineError):
    """The server rejected the request (HTTP 4xx): retrying will not help."""

    def __init__(self, message: str, status: int, body: Any):
        super().__init__(message)
        self.status, self.body = status, body


class EngineUnavailableError(EngineError):
    """No answer (connection refused/reset, timeout, 5xx) after all retries: the engine is down or stuck."""


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

    def __post_init__(self):
        self.url = self.url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url={self.url!r} must start with http:// or https://")
        if self.retries < 0 or self.backoff_s < 0:
            raise ValueError("retries and backoff_s must be >= 0")
        if self.workers < 1:
            raise ValueError(f"workers={self.workers} must be >= 1 (the server's tp size)")


class HttpEngine:
    """The Engine protocol over HTTP against one SGLang-compatible server."""

    def __init__(self, config: HttpEngineConfig | str):
        self.config = HttpEngineConfig(url=config) if isinstance(config, str) else config
        self._updater: DistributedWeightUpdater | None = None

    @property
    def url(self) -> str:
        return self.config.url

    def __repr__(self) -> str:
        return f"HttpEngine({self.url})"

    # ------------------------------------------------------------------------------- transport
    def request(self, method: str, path: str, body: Any = None, timeout_s: float | None = None,
                retries: int | None = None, parse: bool = True) -> Any:
        """One call with retries; returns the parsed JSON (or text). Raises EngineRequestError on 4xx,
        EngineUnavailableError when every attempt failed to get an answer."""
        timeout_s = self.config.control_timeout_s if timeout_s is None else timeout_s
        retries = self.config.retries if retries is None else retries
        data = None if body is None else json.dumps(body).encode()
        delay = self.config.backoff_s
        last = ""
        for attempt in range(retries + 1):
            req = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"} if data else {})
            try:
                with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                    raw = resp.read()
                return _decode(raw) if parse else raw.decode(errors="replace")
            except urllib.error.HTTPError as e:
                raw = e.read()
                payload = _decode(raw)
                if 400 <= e.code < 500:
                    raise EngineRequestError(f"{method} {self.url}{path} -> HTTP {e.code}: {_message(payload)}",
                                             e.code, payload) from None
                last = f"HTTP {e.code}: {_message(payload)}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            if attempt < retries:
                time.sleep(delay)
                delay = min(delay * 2, self.config.max_backoff_s)
        raise EngineUnavailableError(f"{method} {self.url}{path} failed after {retries + 1} attempt(s): {last}")

    # ------------------------------------------------------------------------------- Engine protocol
    def generate(self, prompts: list[list[int]], params: SamplingParams, first_prompt_index: int = 0) -> list[Sample]:
        entries: list[tuple[list[int], dict]] = []
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                seed = None if params.seed is None else derive_seed(params.seed, first_prompt_index + i, j)
                entries.append((list(prompt), params_to_json(params, seed)))
        samples: list[Sample] = []
        step = self.config.max_entries_per_request
        for start in range(0, len(entries), step):
            chunk = entries[start:start + step]
            body = {"input_ids": [p for p, _ in chunk], "sampling_params": [sp for _, sp in chunk],
                    "return_logprob": True, "logprob_start_len": -1, "stream": False}
            out = self.request("POST", "/generate", body, timeout_s=self.config.generate_timeout_s)
            if not isinstance(out, list) or len(out) != len(chunk):
                raise EngineError(f"{self.url}/generate answered {type(out).__name__} of "
                                  f"{len(out) if isinstance(out, list) else 1} entries for {len(chunk)}")
            try:
                samples.extend(sample_from_json(p, e) for (p, _), e in zip(chunk, out))
            except ValueError as e:
                raise EngineError(f"{self.url}/generate: {e}") from e
        return samples

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> None:
        """Sends full HF-named tensors over a weight-update group of this engine alone (created on first use
        with DistributedUpdateConfig's defaults; use DistributedWeightUpdater to configure or share one)."""
        if self._updater is None:
            self._updater = DistributedWeightUpdater([self])
            self._updater.connect()
        self._updater.update(named_tensors, weight_version=weight_version)

    def release_memory(self, tags: list[str] | None = None) -> None:
        self.request("POST", "/release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self.request("POST", "/resume_memory_occupation", {"tags": tags})

    def health(self) -> bool:
        try:
            self.request("GET", "/health", retries=0, parse=False)
            return True
        except EngineError:
            return False

    # ------------------------------------------------------------------------------- extras
    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        """log softmax(logits) (temperature 1) of each prompt token given its prefix; None for the first
        (SGLang's input_token_logprobs with logprob_start_len=0)."""
        sp = params_to_json(SamplingParams(max_new_tokens=1, temperature=0.0), seed=None)
        out = self.request("POST", "/generate", {"input_ids": list(prompt_ids), "sampling_params": sp,
                                                 "return_logprob": True, "logprob_start_len": 0},
                           timeout_s=self.config.generate_timeout_s)
        try:
            entries = out["meta_info"]["input_token_logprobs"]
        except (KeyError, TypeError) as e:
            raise EngineError(f"{self.url}/generate returned no input_token_logprobs") from e
        return [None if e[0] is None else float(e[0]) for e in entries]

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
        self.request("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self.request("POST", "/continue_generation", {})

    def model_info(self) -> dict:
        try:
            return self.request("GET", "/get_model_info")
        except EngineRequestError:  # newer SGLang renamed it
            return self.request("GET", "/model_info")

    def weight_version(self) -> str | None:
        return self.model_info().get("weight_version")

    def close(self) -> None:
        if self._updater is not None:
            self._updater.close()
            self._updater = None


def _decode(raw: bytes) -> Any:
    text = raw.decode(errors="replace")
    try:
        return json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return text


def _message(payload: Any) -> str:
    if isinstance(payload, dict):
        if isinstance(payload.get("error"), dict):
            return str(payload["error"].get("message"))
        for key in ("message", "detail"):
            if key in payload:
                return str(payload[key])
    return str(payload)[:2000]


# ------------------------------------------------------------------------------------------------
@dataclass
class DistributedUpdateConfig:
    """Trainer side of /init_weights_update_group + /update_weights_from_distributed."""

    master_address: str = "127.0.0.1"
    """An address of the trainer's machine that every engine can reach (hosts the rendezvous store)."""
    master_port: int | None = None
    """Rendezvous port; None picks a free one."""
    group_name: str = "weight_update_group"
    backend: str | None = None
    """nccl | gloo; None = nccl with a GPU, else gloo."""
    bucket_bytes: int = 512 << 20
    """Bytes per bucket (one HTTP request + one broadcast each with flattened_bucket)."""
    load_format: str | None = "auto"
    """"flattened_bucket" (one broadcast per bucket: fewest collectives, SGLang's fast path on GPUs),
    None (one broadcast per tensor; megaopd serve receives each straight into the model's tensor, which
    on CPUs saves a copy that costs as much as the transfer), or "auto": flattened_bucket with nccl,
    None with gloo."""
    timeout_s: float = 600.0
    """Longest wait for the group to form and for one bucket to be broadcast and loaded."""
    flush_cache: bool = True

    def __post_init__(self):
        if self.load_format not in (None, "flattened_bucket", "auto"):
            raise ValueError(f"load_format={self.load_format!r}; use None, 'flattened_bucket' or 'auto'")
        if self.bucket_bytes < 1:
            raise ValueError("bucket_bytes must be positive")


class DistributedWeightUpdater:
    """Rank 0 of a weight-update group spanning one or more HTTP engines (see the module docstring)."""

    def __init__(self, engines: list[HttpEngine], config: DistributedUpdateConfig | None = None):
        if not engines:
            raise ValueError("DistributedWeightUpdater needs at least one engine")
        self.engines = list(engines)
        self.config = config or DistributedUpdateConfig()
        self.backend = self.config.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.load_format = self.config.load_format
        if self.load_format == "auto":
            self.load_format = "flattened_bucket" if self.backend == "nccl" else None
        self.pg = None
        self.group_name = self.config.group_name
        self._abandoned: list = []  # groups left with a pending broadcast; kept alive, never reused
        self.world_size = 1 + sum(e.config.workers for e in self.engines)

    def connect(self) -> None:
        """Forms the group: every engine joins from a background POST while this process hosts rank 0."""
        if self.pg is not None:
            return
        from megaopd.parallel.launch import find_free_port

        port = self.config.master_port or find_free_port()
        # torch registers groups by name per process; after an abandoned group (or beside another
        # updater) take a fresh name. Engines use whatever name the request carries.
        from torch.distributed.distributed_c10d import _world

        taken, k = set(_world.pg_names.values()), 1
        self.group_name = self.config.group_name
        while self.group_name in taken:
            self.group_name, k = f"{self.config.group_name}_{k}", k + 1
        offsets, offset = [], 1
        for e in self.engines:
            offsets.append(offset)
            offset += e.config.workers
        bodies = [{"master_address": self.config.master_address, "master_port": port, "rank_offset": off,
                   "world_size": self.world_size, "group_name": self.group_name, "backend": self.backend}
                  for off in offsets]
        calls = self._post_all("/init_weights_update_group", bodies)
        try:
            pg = dist_group.init_custom_process_group(self.backend, self.config.master_address, port, 0,
                                                      self.world_size, self.group_name,
                                                      timeout_s=self.config.timeout_s)
        except Exception as e:
            errors = _finished_errors(calls)
            raise EngineError(f"weight-update group {self.group_name!r} did not form on "
                              f"{self.config.master_address}:{port} (world size {self.world_size}): {e}"
                              + (f"; engines said: {errors}" if errors else "")) from e
        errors = _join(calls, self.config.timeout_s)
        if errors:
            dist_group.destroy_custom_process_group(pg)
            raise EngineError(f"engines failed to join the weight-update group: {errors}")
        self.pg = pg

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> None:
        """Broadcasts full HF-named tensors to every engine, bucket by bucket, in the given order."""
        if self.pg is None:
            self.connect()
        # Buckets are taken lazily, one ahead (to know which is last): a trainer's generator that gathers
        # TP/PP shards per tensor is consumed while earlier buckets are on the wire, never all at once.
        bucket_iter = dist_group.buckets(named_tensors, self.config.bucket_bytes)
        refused: list[str] = []
        flattened = self.load_format == "flattened_bucket"

        def prepared(bucket):
            tensors = [t.detach().to(self.device) for _, t in bucket]
            return bucket, tensors, (dist_group.flatten_bucket(tensors) if flattened else None)

        nxt = next(bucket_iter, None)
        nxt = prepared(nxt) if nxt is not None else None
        k = 0
        while nxt is not None:
            bucket, tensors, flat = nxt
            k += 1
            following = next(bucket_iter, None)
            last = following is None
            names = [n for n, _ in bucket]
            body = {"names": names, "dtypes": [dist_group.dtype_name(t.dtype) for t in tensors],
                    "shapes": [list(t.shape) for t in tensors], "group_name": self.group_name,
                    "flush_cache": self.config.flush_cache and last, "load_format": self.load_format,
                    # The version flips with the last bucket, so it never names half-loaded weights.
                    "weight_version": weight_version if last else None}
            calls = self._post_all("/update_weights_from_distributed", [body] * len(self.engines))
            if flattened:
                works = [dist_group.broadcast(flat, self.pg, async_op=True)]
            else:
                works = [dist_group.broadcast(t.contiguous(), self.pg, async_op=True) for t in tensors]
            # Pack the next bucket while this one is on the wire (on a CPU the copy costs about as much).
            nxt = None if last else prepared(following)
            self._wait_broadcast(works, calls)
            errors = _join(calls, self.config.timeout_s)
            if errors and not all(any(m in e for m in _AFTER_RECEIPT) for e in errors):
                # Refused before receiving (unknown group, bad request): a small broadcast may have
                # completed into socket buffers, but the group is out of step now.
                self._abandon()
                raise EngineError(f"weight update refused (bucket {k}): {errors}; "
                                  "the weight-update group is abandoned, connect() again")
            if errors:
                # The engines received the bucket and refused to load it (names/shapes): the group is
                # still in step, so go on and report every refused bucket at the end.
                refused.append(f"bucket {k} ({len(names)} tensors): " + "; ".join(errors))
        if refused:
            raise EngineError(f"weight update refused for {len(refused)} of {k} bucket(s) (each "
                              "refused bucket loaded nothing; accepted ones were loaded):\n" + "\n".join(refused))

    def _wait_broadcast(self, works, calls) -> None:
        # Poll instead of work.wait(): an engine that refused before receiving leaves the broadcast
        # pending until the group times out; its HTTP answer tells us to stop waiting now.
        deadline = time.monotonic() + self.config.timeout_s
        pause = 1e-4
        while not all(w.is_completed() for w in works):
            errors = _finished_errors(calls)
            if errors:
                self._abandon()
                raise EngineError(f"weight update refused before the broadcast completed: {errors}; "
                                  "the weight-update group is abandoned, connect() again")
            if time.monotonic() > deadline:
                self._abandon()
                raise EngineError(f"weight broadcast did not complete in {self.config.timeout_s:.0f}s")
            time.sleep(pause)
            pause = min(pause * 1.5, 5e-3)  # short waits first: small buckets finish in microseconds
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:  # a peer closed the group (engine died or dropped it)
            self._abandon()
            errors = _join(calls, min(self.config.timeout_s, 10.0))
            raise EngineError(f"weight broadcast failed: {e}; engines said: {errors}; "
                              "the weight-update group is abandoned, connect() again") from e

    def _abandon(self) -> None:
        # A broadcast is left pending on the group: keep the object alive (destroying it under a pending
        # op can hang) and never use it again; tell the engines to drop their side.
        self._abandoned.append(self.pg)
        self.pg = None
        self._destroy_on_engines()

    def _destroy_on_engines(self) -> None:
        for e in self.engines:
            try:
                e.request("POST", "/destroy_weights_update_group", {"group_name": self.group_name}, retries=0,
                          timeout_s=10.0)
            except EngineError:
                pass

    def close(self) -> None:
        """Destroys the group on the engines and here (best effort: engines may be gone)."""
        if self.pg is None:
            return
        self._destroy_on_engines()
        dist_group.destroy_custom_process_group(self.pg)
        self.pg = None

    def _post_all(self, path: str, bodies: list[dict]) -> list["_Call"]:
        calls = [_Call(e, path, b, self.config.timeout_s) for e, b in zip(self.engines, bodies)]
        for c in calls:
            c.start()
        return calls


# Engine messages for a bucket that was received and then not loaded (megaopd serve; SGLang's load
# failure): the group is still in step. Any other refusal abandons the group.
_AFTER_RECEIPT = ("Failed to update weights", "Failed to update parameter online")


class _Call(threading.Thread):
    """One POST in a background thread (group formation and updates block until the trainer acts)."""

    def __init__(self, engine: HttpEngine, path: str, body: dict, timeout_s: float):
        super().__init__(daemon=True, name=f"megaopd-post{path}")
        self.engine, self.path, self.body, self.timeout_s = engine, path, body, timeout_s
        self.result: Any = None
        self.error: str | None = None

    def run(self):
        try:
            # No retries: these calls are not idempotent (a second join or receive would desynchronize).
            self.result = self.engine.request("POST", self.path, self.body, timeout_s=self.timeout_s, retries=0)
            if isinstance(self.result, dict) and self.result.get("success") is False:
                self.error = str(self.result.get("message"))
        except EngineError as e:
            self.error = str(e)


def _finished_errors(calls: list[_Call]) -> list[str]:
    return [f"{c.engine.url}: {c.error}" for c in calls if not c.is_alive() and c.error]


def _join(calls: list[_Call], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    for c in calls:
        c.join(timeout=max(0.0, deadline - time.monotonic()))
    errors = _finished_errors(calls)
    errors += [f"{c.engine.url}: no answer in {timeout_s:.0f}s" for c in calls if c.is_alive()]
    return errors
