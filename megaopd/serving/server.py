"""The server of `megaopd serve` (megaopd.serving.cli): a model runner behind the subset of SGLang's native
HTTP API that megaopd uses; `start()` runs it in a background thread (tests, benchmarks).

    server = RolloutServer(ServeConfig(hf_dir=DIR, port=0), engine=runner).start()   # server.url

Endpoints (schemas as SGLang's; docs/engines.md "SGLang's HTTP API, as megaopd uses it"):
  POST /generate                                   input_ids (one or a batch) or text, sampling_params;
                                                   prefill scoring: max_new_tokens 0, return_logprob,
                                                   logprob_start_len, top_logprobs_num, token_ids_logprob
                                                   -> input_token_logprobs, input_top_logprobs,
                                                   input_token_ids_logprobs (temperature 1; null AT
                                                   logprob_start_len for any start), output_top_logprobs /
                                                   output_token_ids_logprobs (the next token's), as SGLang
  POST /init_weights_update_group                  joins the trainer's group (blocks until it forms)
  POST /update_weights_from_distributed            receives broadcast tensors, loads them by HF name
                                                   (per-tensor format: straight into the parameters)
  POST /update_weights_from_disk                   loads *.safetensors of a directory by HF name
  POST /load_lora_adapter                          lora_name with lora_path (a peft adapter folder, under
                                                   the same allowed roots) or adapter_config + adapter_model
                                                   (the folder's two files in the request: the trainer's
                                                   adapter sync), merged into the served base (float32)
  POST /destroy_weights_update_group
  POST /begin_weight_update  /end_weight_update    only when acting as SGLang >= 0.5.20 (--sglang-version):
                                                   then updates from distributed / tensor are refused
                                                   (HTTP 400) outside such a session, as 0.5.2x does;
                                                   acting as an older version, both answer 404
  POST /update_weights_from_tensor                 refused (CUDA IPC handles need GPUs), after the
                                                   session check
  GET|POST /flush_cache    GET /health  GET /health_generate   GET /get_model_info (/model_info)
  GET /ready                                       200 when loaded and not paused, else 503 (SGLang 0.5.23's:
                                                   the rollout client's stall clock reads it)
  GET /get_server_info     POST /release_memory_occupation  /resume_memory_occupation
  POST /pause_generation   /continue_generation   /abort_request     (serving.scheduling)
Memory tags (weights, kv_cache, cuda_graph) can be resumed only after a release: resuming another is
HTTP 400 here (SGLang 0.5.23 dies on it). GET /server_info carries "version" (the SGLang version acted).
Answers have SGLang 0.5.23's keys at every level (meta_info included: fields megaopd has no notion of at
their neutral values), and its errors: HTTP 400 with {"error": {"message"}} for a bad value, the
OpenAI-style {"object": "error", ...} for a request field's type, {"error": "<text>"} for a
sampling_params field's type or name; /health answers 503 until the model is loaded. Held to a real
SGLang server by tests/e2e/sglang (tests/serving/sglang_cases.py lists the refusals, and the requests
refused here on purpose where SGLang does otherwise: docs/engines.md).

Requests that arrive while a batch decodes are queued and decoded together in the next batch (one
scheduler thread: serving.scheduling); each HTTP request is served by its own thread
(ThreadingHTTPServer, stdlib only: serving.http). /generate is serving.generate, the weight updates
serving.weights; this module holds the configuration, the endpoints table and the small endpoints.

Access (serving.access, serving.http): with an API key (ServeConfig.api_key: --api-key or MEGAOPD_API_KEY)
every endpoint but /health* needs `Authorization: Bearer <key>` (401 without); without one the server
binds loopback only. Bodies over max_body_bytes answer 413, sockets time out, weights load only from
allowed folders and groups form only with allowed hosts (403), NaN / inf weights and sampling values
are refused (400). docs/engines.md "Running megaopd serve safely".
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from megaopd.engine.config import EmbeddedEngineConfig
from megaopd.engine.memory import MemoryStateError, memory_tags
from megaopd.engine.rows import RowRequest
from megaopd.engine.runner import ModelRunner
from megaopd.rollout.schema import WEIGHT_UPDATE_SESSION_SINCE, BadRequest, parse_version
from megaopd.serving.access import SyncHosts, WeightRoots, check_bind, check_key
from megaopd.serving.generate import generate
from megaopd.serving.http import HttpError, HttpLimits, HttpServer, Route, make_handler
from megaopd.serving.scheduling import PAUSE_MODES, PauseControl, Scheduler
from megaopd.serving.weights import WeightUpdates

log = logging.getLogger("megaopd.serve")


@dataclass
class ServeConfig:
    """Command-line settings of `megaopd serve`."""

    hf_dir: str
    """HF model directory to serve."""
    port: int = 30000
    host: str = "127.0.0.1"
    """Interface to bind. Anything but loopback needs api_key (refused at start-up otherwise)."""
    api_key: str | None = field(default=None, repr=False)
    """The key every request but /health* must carry as `Authorization: Bearer <key>` (SGLang's --api-key);
    None: no key, loopback only. The CLI reads MEGAOPD_API_KEY when --api-key is not given. Never printed."""
    max_body_bytes: int = 64 << 20
    """Largest request body (HTTP 413 above it, before it is read). 64 MiB holds about 8M token ids as JSON:
    e.g. 1024 prompts of 8k tokens, or 256 prefills of a 32k context."""
    socket_timeout_s: float = 60.0
    """Longest wait on one socket read or write: a client that stops sending mid-request frees its thread."""
    listen_backlog: int = 1024
    """Connections the kernel queues before they are accepted (the stdlib's 5 reset a burst of the trainer's)."""
    allowed_weight_roots: list[str] = field(default_factory=list)
    """Folders /update_weights_from_disk may read besides the served model's (hf_dir)."""
    allowed_sync_hosts: list[str] = field(default_factory=list)
    """Hosts /init_weights_update_group may connect to besides loopback: the trainer's rank 0
    (rollout.weight_sync_address) when it runs on another machine."""
    max_batch_size: int = 64
    """Rows decoded together."""
    device: str = "auto"
    dtype: str = "float32"
    release_weights: str = "auto"
    """keep | offload | discard | auto: what /release_memory_occupation does to the weights."""
    group_timeout_s: float = 300.0
    """How long a weight-update group may take to form, and a broadcast to arrive."""
    sglang_version: str = "0.5.23"
    """The SGLang version whose weight-update protocol this server speaks and reports in /server_info:
    >= 0.5.20 demands /begin_weight_update ... /end_weight_update around updates, older has neither."""

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} must be in [0, 65535] (0 picks a free one)")
        if parse_version(self.sglang_version) is None:
            raise ValueError(f"sglang_version={self.sglang_version!r}: give x.y.z, e.g. 0.5.23 or 0.5.2")
        if self.max_body_bytes < 1 or self.socket_timeout_s <= 0 or self.listen_backlog < 1:
            raise ValueError(
                f"max_body_bytes={self.max_body_bytes}, socket_timeout_s={self.socket_timeout_s} and "
                f"listen_backlog={self.listen_backlog} must all be positive"
            )
        check_key(self.api_key)
        check_bind(self.host, self.api_key)

    @property
    def weight_update_sessions(self) -> bool:
        """Whether the acted version demands weight-update sessions."""
        return parse_version(self.sglang_version) >= WEIGHT_UPDATE_SESSION_SINCE

    def engine_config(self) -> EmbeddedEngineConfig:
        return EmbeddedEngineConfig(
            hf_dir=self.hf_dir,
            device=self.device,
            dtype=self.dtype,
            max_batch_size=self.max_batch_size,
            release_weights=self.release_weights,
        )


class RolloutServer:
    """The HTTP server; `serve_forever()` for the CLI, `start()` for a background thread (tests)."""

    def __init__(self, config: ServeConfig, engine: ModelRunner | None = None):
        self.config = config
        self.engine: ModelRunner | None = None
        self.scheduler: Scheduler | None = None
        self.load_error: str | None = None
        self.weights = WeightUpdates(
            self._engine,
            config.group_timeout_s,
            config.weight_update_sessions,
            WeightRoots([config.hf_dir, *config.allowed_weight_roots]),
            SyncHosts(["127.0.0.1", *config.allowed_sync_hosts]),
        )
        limits = HttpLimits(
            api_key=config.api_key, max_body_bytes=config.max_body_bytes, socket_timeout_s=config.socket_timeout_s
        )
        self.httpd = HttpServer(
            (config.host, config.port), make_handler(self._routes(), limits), backlog=config.listen_backlog
        )
        self.port = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None
        if engine is not None:
            self._set_engine(engine)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def _set_engine(self, engine: ModelRunner):
        self.engine = engine
        self.scheduler = Scheduler(engine)

    def load_engine(self):
        """Builds the runner (the slow part of start-up); /health answers 503 until it is done."""
        try:
            self._set_engine(ModelRunner(self.config.engine_config()))
        except Exception as e:  # noqa: BLE001 - kept for /health and the log; the server stays up to say why
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("megaopd serve: failed to load %s: %s", self.config.hf_dir, self.load_error)
            raise

    def start(self) -> "RolloutServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="megaopd-serve-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self):
        self.httpd.serve_forever()

    def shutdown(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.scheduler is not None:
            self.scheduler.stop()
        self.weights.close()

    def _engine(self) -> ModelRunner:
        if self.engine is None:
            raise HttpError(503, {"error": {"message": self.load_error or "the model is still loading"}})
        return self.engine

    def _pauses(self) -> PauseControl:
        self._engine()  # 503 while loading
        return self.scheduler.pauses

    def health_generate(self) -> bool:
        """One greedy token through the scheduler: the whole path a /generate takes."""
        engine = self._engine()
        row = RowRequest(prompt_ids=[0], max_new_tokens=1, temperature=0.0, seed=0)
        try:
            self.scheduler.run([row], timeout=20)
            return engine.health()
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return False

    # ----------------------------------------------------------------------------------- endpoints
    def _routes(self) -> dict[tuple[str, str], Route]:
        """(method, path) -> endpoint: the body (parsed JSON or None) in, (HTTP status, body) out."""
        w = self.weights
        routes: dict[tuple[str, str], Route] = {
            ("POST", "/generate"): self._generate,
            ("POST", "/init_weights_update_group"): _with_success(w.init_group),
            ("POST", "/update_weights_from_distributed"): _with_success(w.update_from_distributed),
            ("POST", "/update_weights_from_disk"): _with_success(w.update_from_disk),
            ("POST", "/update_weights_from_tensor"): _with_success(w.update_from_tensor),
            ("POST", "/load_lora_adapter"): _with_success(w.load_lora_adapter),
            ("POST", "/destroy_weights_update_group"): _with_success(w.destroy_group),
            ("GET", "/flush_cache"): self._flush,
            ("POST", "/flush_cache"): self._flush,
            ("GET", "/health"): self._health,
            ("GET", "/health_generate"): self._health_generate,
            ("GET", "/ready"): self._ready,
            ("GET", "/get_model_info"): self._model_info,
            ("GET", "/model_info"): self._model_info,
            ("GET", "/get_server_info"): self._server_info,
            ("GET", "/server_info"): self._server_info,
            ("POST", "/release_memory_occupation"): self._release,
            ("POST", "/resume_memory_occupation"): self._resume,
            ("POST", "/pause_generation"): self._pause,
            ("POST", "/continue_generation"): self._continue,
            ("POST", "/abort_request"): self._abort,
        }
        if self.config.weight_update_sessions:  # older SGLang has neither endpoint (404)
            routes[("POST", "/begin_weight_update")] = _with_success(w.begin_weight_update)
            routes[("POST", "/end_weight_update")] = _with_success(w.end_weight_update)
        return routes

    def _generate(self, req):
        engine = self._engine()
        refusal = self.weights.generation_refusal()
        if refusal:
            raise BadRequest(refusal)
        return 200, generate(engine, self.scheduler.run, req)

    def _flush(self, _req):
        if self._engine().flush_cache():
            return 200, (
                "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                "waiting requests, the operation will not be performed.)\n"
            )
        return 400, "Cache not flushed: requests are running; retry when idle.\n"

    def _health(self, _req):
        return (200, "") if self._engine().health() else (503, "")

    def _ready(self, _req):
        """SGLang 0.5.23's is_ready: started and not paused (memory released does not count, as there)."""
        self._engine()  # 503 while loading
        return (503, "") if self.scheduler.pauses.paused else (200, "")

    def _health_generate(self, _req):
        return (200, "") if self.health_generate() else (503, "")

    def _model_info(self, _req):
        return 200, self._engine().model_info()

    def _server_info(self, _req):
        engine, config = self._engine(), self.config
        return 200, {
            "model_path": config.hf_dir,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "weight_version": engine.weight_version,
            "max_running_requests": config.max_batch_size,
            "host": config.host,
            "port": self.port,
            "version": config.sglang_version,
            "megaopd_serve": True,
            "internal_states": [{"running": engine.running, "paused": self.scheduler.pauses.paused}],
        }

    def _release(self, req):
        tags = _tags(req)
        self._engine().release_memory(tags)
        return 200, None

    def _resume(self, req):
        tags = _tags(req)
        try:
            self._engine().resume_memory(tags)
        except MemoryStateError as e:  # SGLang 0.5.23 dies here; we answer why instead
            raise BadRequest(str(e)) from e
        return 200, None

    def _pause(self, req):
        mode = (req or {}).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode={mode!r}: Input should be 'abort', 'retract' or 'in_place'", kind="schema")
        self._pauses().pause(mode)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _continue(self, _req):
        self._pauses().continue_generation()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _abort(self, req):
        if (req or {}).get("abort_all"):
            self._pauses().abort_all()
        return 200, ""


def _with_success(fn) -> Route:
    """An endpoint answering {"success", ...}: HTTP 200 when it succeeded, else 400 (as SGLang)."""

    def run(req):
        res = fn(req)
        return (200 if res["success"] else 400), res

    return run


def _tags(req: Any):
    """The memory tags of a release / resume body (null or absent: all), checked as SGLang would."""
    tags = (req or {}).get("tags") if isinstance(req, (dict, type(None))) else None
    if tags is not None and not isinstance(tags, list):
        raise BadRequest(f"tags={tags!r}: use null or a list of 'weights' / 'kv_cache' / 'cuda_graph'")
    try:
        memory_tags(tags, "tags")
    except MemoryStateError as e:
        raise BadRequest(str(e)) from e
    return tags
