"""`megaopd serve`: the embedded engine behind the subset of SGLang's native HTTP API that megaopd uses.

    megaopd serve --hf-dir DIR --port 30000 [--host 127.0.0.1] [--max-batch-size 64] [--sglang-version 0.5.23]

Endpoints (schemas as SGLang's; see /work/shared/design/SGLANG-PROTOCOL.md):
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
  POST /destroy_weights_update_group
  POST /begin_weight_update  /end_weight_update    only when acting as SGLang >= 0.5.20 (--sglang-version):
                                                   then updates from distributed / tensor are refused
                                                   (HTTP 400) outside such a session, as 0.5.2x does;
                                                   acting as an older version, both answer 404
  POST /update_weights_from_tensor                 refused (CUDA IPC handles need GPUs), after the
                                                   session check
  GET|POST /flush_cache    GET /health  GET /health_generate   GET /get_model_info (/model_info)
  GET /get_server_info     POST /release_memory_occupation  /resume_memory_occupation
  POST /pause_generation   /continue_generation   /abort_request
Memory tags (weights, kv_cache, cuda_graph) can be resumed only after a release: resuming another is
HTTP 400 here (SGLang 0.5.23 dies on it). GET /server_info carries "version" (the SGLang version acted).
Answers have SGLang 0.5.23's keys at every level (meta_info included: fields megaopd has no notion of at
their neutral values), and its errors: HTTP 400 with {"error": {"message"}} for a bad value, the
OpenAI-style {"object": "error", ...} for a request field's type, {"error": "<text>"} for a
sampling_params field's type or name; /health answers 503 until the model is loaded. Held to a real
SGLang server by tests/e2e/sglang (tests/serving/sglang_cases.py lists the refusals, and the requests
refused here on purpose where SGLang does otherwise: docs/engines.md).

Requests that arrive while a batch decodes are queued and decoded together in the next batch (one
scheduler thread); each HTTP request is served by its own thread (ThreadingHTTPServer, stdlib only).
Bind to 127.0.0.1 unless the trainer is on another machine: the API has no authentication.
"""
from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import torch

from megaopd.engine.config import EmbeddedEngineConfig
from megaopd.engine.memory import EngineReleasedError, MemoryStateError, memory_tags
from megaopd.engine.rows import RowRequest, RowResult
from megaopd.engine.runner import ModelRunner
from megaopd.engine.weights import WeightMismatchError
from megaopd.parallel import custom_group as dist_group
from megaopd.rollout import weight_wire as wire
from megaopd.rollout.embedded import row_request
from megaopd.rollout.protocol import expand_samples
from megaopd.rollout.schema import (WEIGHT_UPDATE_SESSION_SINCE, BadRequest, finish_reason_json, parse_params,
                                    parse_version)

log = logging.getLogger("megaopd.serve")


@dataclass
class ServeConfig:
    """Command-line settings of `megaopd serve`."""

    hf_dir: str
    """HF model directory to serve."""
    port: int = 30000
    host: str = "127.0.0.1"
    """Interface to bind; 127.0.0.1 keeps the unauthenticated API off the network."""
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

    @property
    def weight_update_sessions(self) -> bool:
        """Whether the acted version demands weight-update sessions."""
        return parse_version(self.sglang_version) >= WEIGHT_UPDATE_SESSION_SINCE

    def engine_config(self) -> EmbeddedEngineConfig:
        return EmbeddedEngineConfig(hf_dir=self.hf_dir, device=self.device, dtype=self.dtype,
                                    max_batch_size=self.max_batch_size, release_weights=self.release_weights)


@dataclass
class _Job:
    rows: list[RowRequest]
    epoch: int
    future: Future


class _Scheduler:
    """One thread that decodes queued rows; everything queued while a batch runs joins the next one."""

    def __init__(self, engine: ModelRunner):
        self.engine = engine
        self.queue: "queue.Queue[_Job]" = queue.Queue()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="megaopd-serve-scheduler", daemon=True)
        self.thread.start()

    def submit(self, rows: list[RowRequest]) -> Future:
        job = _Job(rows, self.engine.abort_epoch, Future())
        self.queue.put(job)
        return job.future

    def _loop(self):
        while not self.stopped.is_set():
            try:
                jobs = [self.queue.get(timeout=0.2)]
            except queue.Empty:
                continue
            while True:
                try:
                    jobs.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            # Jobs from different abort epochs cannot share a run (an old one must come back aborted).
            by_epoch: dict[int, list[_Job]] = {}
            for job in jobs:
                by_epoch.setdefault(job.epoch, []).append(job)
            for epoch, group in by_epoch.items():
                rows = [r for job in group for r in job.rows]
                try:
                    results = self.engine.run(rows, epoch=epoch)
                except BaseException as e:  # noqa: BLE001 - reported to every waiting request
                    for job in group:
                        job.future.set_exception(e)
                    continue
                i = 0
                for job in group:
                    job.future.set_result(results[i:i + len(job.rows)])
                    i += len(job.rows)


class RolloutServer:
    """The HTTP server; `serve_forever()` for the CLI, `start()` for a background thread (tests)."""

    def __init__(self, config: ServeConfig, engine: ModelRunner | None = None):
        self.config = config
        self.engine: ModelRunner | None = None
        self.scheduler: _Scheduler | None = None
        self.groups: dict[str, dist_group.dist.ProcessGroup] = {}
        self._recv_buffers: dict[str, torch.Tensor] = {}  # group name -> reusable flattened-bucket buffer
        self.load_error: str | None = None
        self.session: str | None = None  # selector of the open weight-update session (newer protocol)
        self._session_lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((config.host, config.port), _make_handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None
        if engine is not None:
            self._set_engine(engine)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def _set_engine(self, engine: ModelRunner):
        self.engine = engine
        self.scheduler = _Scheduler(engine)

    def load_engine(self):
        """Builds the engine (the slow part of start-up); /health answers 503 until it is done."""
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
            self.scheduler.stopped.set()
        for pg in self.groups.values():
            dist_group.destroy_custom_process_group(pg)
        self.groups.clear()

    # ----------------------------------------------------------------------------------- endpoints
    def _engine(self) -> ModelRunner:
        if self.engine is None:
            raise _HttpError(503, {"error": {"message": self.load_error or "the model is still loading"}})
        return self.engine

    def generate(self, req: Any) -> Any:
        engine = self._engine()
        if not isinstance(req, dict):
            raise BadRequest("the request body must be a JSON object", kind="schema")
        given = [k for k in ("text", "input_ids", "input_embeds") if req.get(k) is not None]
        if not given:
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        if len(given) > 1:  # SGLang 0.5.23 silently uses input_ids: refused here, so a caller's mix-up shows
            raise BadRequest(f"give exactly one of text, input_ids, input_embeds (got {given})")
        if req.get("stream"):
            raise BadRequest("stream=true is not supported by megaopd serve")
        if req.get("input_embeds") is not None:
            raise BadRequest("input_embeds is not supported by megaopd serve")
        prompts, single = self._prompts(engine, req)
        sp = req.get("sampling_params")
        if isinstance(sp, list):
            if single or len(sp) != len(prompts):
                raise BadRequest(f"sampling_params is a list of {len(sp)} for {len(prompts)} prompt(s)")
            params = [parse_params(p) for p in sp]
        else:
            params = [parse_params(sp)] * len(prompts)
        return_logprob = req.get("return_logprob", False)
        return_logprob = return_logprob if isinstance(return_logprob, list) else [bool(return_logprob)] * len(prompts)
        start_len = req.get("logprob_start_len", -1)
        start_len = start_len if isinstance(start_len, list) else [start_len] * len(prompts)
        rids = req.get("rid")
        rids = rids if isinstance(rids, list) else [rids] * len(prompts)
        top_num, at_ids = _prefill_options(req, len(prompts))
        for i, p in enumerate(params):
            if (top_num[i] or at_ids[i]) and (p.max_new_tokens > 0 or start_len[i] is None or start_len[i] < 0
                                              or not return_logprob[i]):
                raise BadRequest("megaopd serve returns top_logprobs_num / token_ids_logprob for input (prompt) "
                                 "positions only: send max_new_tokens=0, return_logprob=true and "
                                 "logprob_start_len >= 0 (prefill scoring), or use a real SGLang server")
            if return_logprob[i] and start_len[i] is not None and start_len[i] > len(prompts[i]):
                raise BadRequest(f"logprob_start_len={start_len[i]} is higher than the number of input tokens "
                                 f"({len(prompts[i])}). Please use a smaller logprob_start_len.")

        # Expand n: prompt i's samples are consecutive entries (prompt-major); an entry with n > 1 gives
        # sample j of prompt i the seed derive_seed(seed, i, j), one with n == 1 keeps the client's seed.
        entries, rows = [], []
        for s in expand_samples(prompts, [p.n for p in params], [p.seed for p in params], keep_single_seeds=True):
            i, p = s.prompt_index, params[s.prompt_index]
            row = row_request(s, p, engine.eos_ids)
            if p.max_new_tokens > 0:
                try:
                    engine.check_row(row)
                except ValueError as e:
                    raise BadRequest(str(e)) from e
            rid = rids[i] if rids[i] is not None and p.n == 1 and len(prompts) == 1 else None
            entries.append((i, p, row, rid or uuid.uuid4().hex))
            rows.append(row)
        t0 = time.perf_counter()
        run_rows = [r for r in rows if r.max_new_tokens > 0]
        try:
            results = self.scheduler.submit(run_rows).result() if run_rows else []
        except EngineReleasedError as e:
            raise BadRequest(str(e)) from e
        latency = time.perf_counter() - t0
        it = iter(results)
        out = []
        for i, p, row, rid in entries:
            res = next(it) if row.max_new_tokens > 0 else RowResult(weight_version=engine.weight_version)
            meta = _meta(rid, res, row, latency)
            if return_logprob[i]:
                start = start_len[i] if start_len[i] is not None else -1
                meta.update(_logprobs_meta(engine, row.prompt_ids, res, start, top_num[i], at_ids[i]))
            out.append({"text": engine.decode(res.output_ids), "output_ids": res.output_ids, "meta_info": meta})
        return out[0] if single and len(out) == 1 else out

    def _prompts(self, engine: ModelRunner, req: dict) -> tuple[list[list[int]], bool]:
        if req.get("text") is not None:
            if engine.tokenizer is None:
                raise BadRequest("this model directory has no tokenizer; send input_ids instead of text")
            text = req["text"]
            texts = [text] if isinstance(text, str) else text
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise BadRequest("text must be a string or a list of strings", kind="schema")
            return [engine.tokenizer(t)["input_ids"] for t in texts], isinstance(text, str)
        ids = req["input_ids"]
        if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
            return [list(ids)], True
        if (isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids)
                and all(_is_int(t) for p in ids for t in p)):
            if any(len(p) == 0 for p in ids):
                raise BadRequest("input_ids has an empty prompt")
            return [list(p) for p in ids], False
        raise BadRequest("input_ids must be a non-empty list of integers or a list of such lists", kind="schema")

    def init_group(self, req: dict) -> dict:
        self._engine()
        _require(req, ("master_address", "master_port", "rank_offset", "world_size"))
        name = req.get("group_name", "weight_update_group")
        backend = req.get("backend", "nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            raise BadRequest("backend 'nccl' needs a GPU; this server runs on the CPU, use backend 'gloo'")
        if name in self.groups:
            raise BadRequest(f"weight update group {name!r} already exists; destroy it first")
        try:
            pg = dist_group.init_custom_process_group(
                backend, str(req["master_address"]), int(req["master_port"]), int(req["rank_offset"]),
                int(req["world_size"]), name, timeout_s=self.config.group_timeout_s)
        except Exception as e:  # noqa: BLE001 - returned to the caller as SGLang does
            return {"success": False, "message": f"Failed to init group: {type(e).__name__}: {e}"}
        self.groups[name] = pg
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_from_distributed(self, req: dict) -> dict:
        engine = self._engine()
        _require(req, ("names", "dtypes", "shapes"))
        names, dtypes, shapes = req["names"], req["dtypes"], req["shapes"]
        name = req.get("group_name", "weight_update_group")
        fmt = req.get("load_format")
        refused = self._session_refusal("update_weights_from_distributed")  # SGLang's first check
        if refused:
            return refused
        if not (len(names) == len(dtypes) == len(shapes)):
            raise BadRequest(f"names, dtypes, shapes have lengths {len(names)}, {len(dtypes)}, {len(shapes)}")
        if fmt not in (None, "flattened_bucket"):
            raise BadRequest(f"load_format {fmt!r}: megaopd serve takes null or 'flattened_bucket'")
        if name not in self.groups:
            return {"success": False, "message": f"Failed to receive weights: Group {name} not in "
                                                 f"{list(self.groups)}. Please call `init_weights_update_group` first."}
        try:
            torch_dtypes = [wire.parse_dtype(d) for d in dtypes]
        except ValueError as e:
            raise BadRequest(str(e)) from e
        pg = self.groups[name]
        device = engine.device if torch.cuda.is_available() and engine.device.type == "cuda" else torch.device("cpu")
        shapes = [tuple(int(x) for x in shape) for shape in shapes]
        version = req.get("weight_version")
        failed = "Failed to update weights: "  # the client reads this prefix as "received, not loaded"
        if fmt is None and device == engine.device:
            # Per-tensor broadcasts land straight in the model's tensors when names, shapes and dtypes
            # all match: no scratch copy (on CPU a copy costs as much as the transfer itself).
            def fill(targets):
                # All receives posted at once, then awaited: no per-tensor round trip.
                for work in [dist_group.broadcast(t, pg, async_op=True) for t in targets]:
                    work.wait()
            try:
                if engine.receive_weights_in_place(list(zip(names, shapes, torch_dtypes)), fill, version):
                    return {"success": True, "message": "Succeeded to update parameter online."}
            except EngineReleasedError as e:
                self._receive_scratch(pg, None, names, torch_dtypes, shapes, device)  # keep the group in step
                return {"success": False, "message": failed + str(e)}
        # Receive everything first, even when names or shapes are wrong: the trainer is broadcasting and
        # would otherwise block until the group times out. Validate, then load all or nothing.
        tensors = self._receive_scratch(pg, fmt, names, torch_dtypes, shapes, device, buffer_key=name)
        try:
            engine.update_weights(tensors, weight_version=version)
        except (WeightMismatchError, EngineReleasedError) as e:
            return {"success": False, "message": failed + str(e)}
        return {"success": True, "message": "Succeeded to update parameter online."}

    def _receive_scratch(self, pg, fmt, names, dtypes, shapes, device, buffer_key=None):
        if fmt == "flattened_bucket":
            nbytes = wire.bucket_nbytes(dtypes, shapes)
            # One receive buffer per group, grown as needed and reused by later buckets: fresh pages
            # would cost a page fault per 4 KiB on every update.
            buf = self._recv_buffers.get(buffer_key)
            if buf is None or buf.numel() < nbytes or buf.device != device:
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
                if buffer_key is not None:
                    self._recv_buffers[buffer_key] = buf
            flat = buf[:nbytes]
            dist_group.broadcast(flat, pg)
            return wire.unflatten_bucket(flat, names, dtypes, shapes)
        tensors = []
        for n, dt, shape in zip(names, dtypes, shapes):
            t = torch.empty(shape, dtype=dt, device=device)
            dist_group.broadcast(t, pg)
            tensors.append((n, t))
        return tensors

    # ------------------------------------------------------------------- weight-update sessions
    def _session_refusal(self, what: str) -> dict | None:
        """SGLang 0.5.2x's answer to an update outside a session (None: go on)."""
        if self.config.weight_update_sessions and self.session is None:
            return {"success": False, "message": f"{what} must run between begin_weight_update() and "
                                                 "end_weight_update()"}
        return None

    def begin_weight_update(self, req: Any) -> dict:
        selector = (req or {}).get("selector", "all") if isinstance(req, (dict, type(None))) else None
        if selector not in ("target", "draft", "all"):
            raise BadRequest(f"selector={selector!r}: Input should be 'target', 'draft' or 'all'", kind="schema")
        with self._session_lock:
            if self.session is not None:
                return {"success": False, "message": "a weight-update session is already open; call "
                                                     "end_weight_update() first"}
            self.session = selector
        return {"success": True, "message": "Success"}

    def end_weight_update(self, _req: Any) -> dict:
        with self._session_lock:
            if self.session is None:
                return {"success": False, "message": "no weight-update session is open; call "
                                                     "begin_weight_update() first"}
            self.session = None
        return {"success": True, "message": "Success"}

    def update_from_tensor(self, req: Any) -> dict:
        self._engine()
        _require(req, ("serialized_named_tensors",))
        payloads = req["serialized_named_tensors"]
        if not isinstance(payloads, list) or not all(isinstance(x, str) and _is_base64(x) for x in payloads):
            raise BadRequest("serialized_named_tensors: Value error, Expected base64-encoded bytes", kind="schema")
        refused = self._session_refusal("update_weights_from_tensor")
        if refused:
            return refused
        return {"success": False, "message": "megaopd serve does not load CUDA IPC handles "
                                             "(/update_weights_from_tensor needs SGLang on the trainer's GPUs)"}

    def update_from_disk(self, req: dict) -> dict:
        from safetensors.torch import load_file

        engine = self._engine()
        _require(req, ("model_path",))
        path = req["model_path"]
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
        if not files:
            return {"success": False, "message": f"Failed to get weights iterator: Cannot find any model weights "
                                                 f"with `{path}`.", "num_paused_requests": 0}
        tensors = {}
        for f in files:
            tensors.update(load_file(os.path.join(path, f)))
        try:
            engine.update_weights(tensors.items(), weight_version=req.get("weight_version"))
        except WeightMismatchError as e:
            return {"success": False, "message": f"Failed to update weights: {e}", "num_paused_requests": 0}
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def destroy_group(self, req: dict) -> dict:
        name = (req or {}).get("group_name", "weight_update_group")
        pg = self.groups.pop(name, None)
        self._recv_buffers.pop(name, None)
        if pg is None:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        dist_group.destroy_custom_process_group(pg)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def health_generate(self) -> bool:
        engine = self._engine()
        row = RowRequest(prompt_ids=[0], max_new_tokens=1, temperature=0.0, seed=0)
        try:
            self.scheduler.submit([row]).result(timeout=20)
            return engine.health()
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return False


def _prefill_options(req: dict, n: int) -> tuple[list[int], list[list[int] | None]]:
    """Per prompt: top_logprobs_num (an int or a list of ints) and token_ids_logprob (one list of ids for
    every prompt, or one list per prompt), validated as SGLang's schema would."""
    top = req.get("top_logprobs_num") or 0
    top = top if isinstance(top, list) else [top] * n
    if len(top) != n or not all(_is_int(k) and k >= 0 for k in top):
        raise BadRequest(f"top_logprobs_num must be a non-negative integer (or one per prompt), got "
                         f"{req.get('top_logprobs_num')!r}", kind="schema")
    ids = req.get("token_ids_logprob")
    if ids is None or ids == []:
        per = [None] * n
    elif isinstance(ids, list) and all(_is_int(t) for t in ids):
        per = [list(ids)] * n
    elif isinstance(ids, list) and len(ids) == n and all(x is None or (isinstance(x, list) and all(_is_int(t) for t in x))
                                                         for x in ids):
        per = [list(x) if x else None for x in ids]
    else:
        raise BadRequest("token_ids_logprob must be a list of token ids, or one such list per prompt", kind="schema")
    return [int(k) for k in top], per


def _meta(rid: str, res: RowResult, row: RowRequest, latency: float) -> dict:
    """SGLang 0.5.23's meta_info of one entry, every field it sends (those megaopd has no notion of at their
    neutral values: no retractions, no reasoning parser, no prefix cache, one data-parallel rank)."""
    n = len(res.output_ids)
    return {"id": rid, "finish_reason": finish_reason_json(res.finish_reason, res.matched, row.max_new_tokens),
            "prompt_tokens": len(row.prompt_ids), "completion_tokens": n, "cached_tokens": 0,
            "cached_tokens_details": None, "weight_version": res.weight_version,
            "weight_versions": [{"version": res.weight_version, "start": 0, "end": n}], "num_retractions": 0,
            "reasoning_tokens": 0, "dp_rank": None, "e2e_latency": latency, "response_sent_to_client_ts": time.time()}


def _logprobs_meta(engine: ModelRunner, prompt_ids: list[int], res: RowResult, start: int, top_num: int,
                   at_ids: list[int] | None) -> dict:
    """The log-prob fields of a return_logprob answer, as SGLang 0.5.23 sends them.

    output_token_logprobs: [logprob, id, null] per output token. input_token_logprobs (always present;
    [] for logprob_start_len -1): entry j is about prompt token start + j, and the entry AT start is
    [null, id, null] for every start, since SGLang scores nothing before start (so the token at start has
    no prefix to be scored from). With top_logprobs_num / token_ids_logprob (prefill scoring only, see
    generate): input_top_logprobs / input_token_ids_logprobs with null at start, and output_top_logprobs /
    output_token_ids_logprobs with one entry, the distribution after the prompt (SGLang computes it even
    with max_new_tokens 0). Temperature 1, as SGLang's input log-probs.
    """
    meta = {"output_token_logprobs": [[lp, t, None] for lp, t in zip(res.logprobs, res.output_ids)],
            "output_token_logprobs_length": len(res.output_ids), "input_token_logprobs": []}
    if start < 0:
        return meta
    if any(not 0 <= int(t) < engine.vocab_size for t in prompt_ids):
        raise BadRequest(f"input_ids has ids outside the vocabulary [0, {engine.vocab_size})")
    if at_ids and any(not 0 <= t < engine.vocab_size for t in at_ids):
        raise BadRequest(f"token_ids_logprob has ids outside the vocabulary [0, {engine.vocab_size})")
    L, n_in = len(prompt_ids), len(prompt_ids) - start  # n_in input entries, about tokens start..L-1
    scores = engine.prompt_scores(prompt_ids, top_num, at_ids, first=min(start + 1, L))
    if n_in:
        meta["input_token_logprobs"] = [[None, prompt_ids[start], None]] + [
            [lp, t, None] for lp, t in zip(scores.logprobs, prompt_ids[start + 1:])]

    def split(rows_KV):  # distributions predicting tokens start+1..L-1, then the one after the prompt
        return ([None] + rows_KV[:n_in - 1]) if n_in else [], rows_KV[-1:]

    if top_num:
        meta["input_top_logprobs"], meta["output_top_logprobs"] = split(
            [[[lp, t, None] for lp, t in zip(v, i)] for v, i in zip(scores.top_logprobs, scores.top_ids)])
    if at_ids:
        meta["input_token_ids_logprobs"], meta["output_token_ids_logprobs"] = split(
            [[[lp, t, None] for lp, t in zip(v, at_ids)] for v in scores.at_ids_logprobs])
    return meta


class _HttpError(Exception):
    def __init__(self, status: int, body: Any):
        super().__init__(str(body))
        self.status, self.body = status, body


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
        return True
    except ValueError:
        return False


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _require(req: Any, keys) -> None:
    if not isinstance(req, dict):
        raise BadRequest("the request body must be a JSON object", kind="schema")
    missing = [k for k in keys if k not in req]
    if missing:
        raise BadRequest(f"missing required field(s) {missing}", kind="schema")


def _tags(req: Any):
    tags = (req or {}).get("tags") if isinstance(req, (dict, type(None))) else None
    if tags is not None and not isinstance(tags, list):
        raise BadRequest(f"tags={tags!r}: use null or a list of 'weights' / 'kv_cache' / 'cuda_graph'")
    try:
        memory_tags(tags, "tags")
    except MemoryStateError as e:
        raise BadRequest(str(e)) from e
    return tags


def _make_handler(server: RolloutServer):
    def ok_json(body):
        return 200, body

    def flush(_req):
        engine = server._engine()
        if engine.flush_cache():
            return 200, ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                         "waiting requests, the operation will not be performed.)\n")
        return 400, "Cache not flushed: requests are running; retry when idle.\n"

    def pause(req):
        mode = (req or {}).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode={mode!r}: Input should be 'abort', 'retract' or 'in_place'", kind="schema")
        server._engine().pause(mode)
        return ok_json({"message": "Generation paused successfully.", "status": "ok"})

    def resume(_req):
        server._engine().continue_generation()
        return ok_json({"message": "Generation continued successfully.", "status": "ok"})

    def abort(req):
        if (req or {}).get("abort_all"):
            server._engine().abort_all()
        return 200, ""

    def release(req):
        tags = _tags(req)
        server._engine().release_memory(tags)
        return ok_json(None)

    def resume_mem(req):
        tags = _tags(req)
        try:
            server._engine().resume_memory(tags)
        except MemoryStateError as e:  # SGLang 0.5.23 dies here; we answer why instead
            raise BadRequest(str(e)) from e
        return ok_json(None)

    def health(_req):
        engine = server._engine()
        return (200, "") if engine.health() else (503, "")

    def model_info(_req):
        return ok_json(server._engine().model_info())

    def server_info(_req):
        engine = server._engine()
        return ok_json({"model_path": server.config.hf_dir, "tp_size": 1, "dp_size": 1, "pp_size": 1,
                        "weight_version": engine.weight_version, "max_running_requests": server.config.max_batch_size,
                        "host": server.config.host, "port": server.port, "version": server.config.sglang_version,
                        "megaopd_serve": True,
                        "internal_states": [{"running": engine.running, "paused": engine.paused}]})

    def with_success(fn: Callable[[Any], dict]):
        def run(req):
            res = fn(req)
            return (200 if res["success"] else 400), res
        return run

    routes: dict[tuple[str, str], Callable[[Any], tuple[int, Any]]] = {
        ("POST", "/generate"): lambda req: ok_json(server.generate(req)),
        ("POST", "/init_weights_update_group"): with_success(server.init_group),
        ("POST", "/update_weights_from_distributed"): with_success(server.update_from_distributed),
        ("POST", "/update_weights_from_disk"): with_success(server.update_from_disk),
        ("POST", "/update_weights_from_tensor"): with_success(server.update_from_tensor),
        ("POST", "/destroy_weights_update_group"): with_success(server.destroy_group),
        ("GET", "/flush_cache"): flush, ("POST", "/flush_cache"): flush,
        ("GET", "/health"): health, ("GET", "/health_generate"): lambda _r: (200, "") if server.health_generate() else (503, ""),
        ("GET", "/get_model_info"): model_info, ("GET", "/model_info"): model_info,
        ("GET", "/get_server_info"): server_info, ("GET", "/server_info"): server_info,
        ("POST", "/release_memory_occupation"): release, ("POST", "/resume_memory_occupation"): resume_mem,
        ("POST", "/pause_generation"): pause, ("POST", "/continue_generation"): resume,
        ("POST", "/abort_request"): abort,
    }
    if server.config.weight_update_sessions:  # older SGLang has neither endpoint (404)
        routes[("POST", "/begin_weight_update")] = with_success(server.begin_weight_update)
        routes[("POST", "/end_weight_update")] = with_success(server.end_weight_update)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the client reuses connections

        def log_message(self, fmt, *args):  # route the access log through logging (quiet by default)
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, body: Any):
            if isinstance(body, str):
                data, ctype = body.encode(), "text/plain; charset=utf-8"
            else:
                data, ctype = json.dumps(body).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _dispatch(self, method: str):
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            fn = routes.get((method, path))
            if fn is None:
                known = any(p == path for _, p in routes)
                return self._send(405 if known else 404, {"detail": "Method Not Allowed" if known else "Not Found"})
            try:
                req = json.loads(raw) if raw.strip() else None
            except json.JSONDecodeError as e:
                return self._send(400, BadRequest(f"JSON decode error: {e}", kind="schema").body())
            try:
                status, body = fn(req)
            except BadRequest as e:
                status, body = 400, e.body()
            except _HttpError as e:
                status, body = e.status, e.body
            except (ValueError, TypeError, KeyError) as e:
                status, body = 400, {"error": {"message": f"{type(e).__name__}: {e}"}}
            except Exception as e:  # noqa: BLE001 - a server must answer, not die
                log.exception("megaopd serve: %s %s failed", method, path)
                status, body = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
            self._send(status, body)

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megaopd serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: loopback only)")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--release-weights", default="auto", choices=["auto", "keep", "offload", "discard"])
    ap.add_argument("--sglang-version", default="0.5.23",
                    help="SGLang version whose weight-update protocol to speak (>= 0.5.20: begin/end sessions)")
    ap.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    config = ServeConfig(hf_dir=args.hf_dir, port=args.port, host=args.host, max_batch_size=args.max_batch_size,
                         device=args.device, dtype=args.dtype, release_weights=args.release_weights,
                         sglang_version=args.sglang_version)
    server = RolloutServer(config)
    # SIGTERM (the launcher's stop) ends serve_forever like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    http = threading.Thread(target=server.serve_forever, name="megaopd-serve-http", daemon=True)
    http.start()  # answer /health with 503 while the model loads
    try:
        server.load_engine()
    except Exception:  # noqa: BLE001 - already logged
        server.shutdown()
        return 1
    print(f"megaopd serve: {config.hf_dir} on {server.url}", file=sys.stderr, flush=True)
    try:
        while http.is_alive():
            http.join(timeout=1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
