"""Weight updates of `megaopd serve`, as SGLang answers them: weight-update groups (join the trainer's
group, receive its broadcasts, leave), loads from a directory, and the 0.5.2x session protocol.

Every endpoint answers {"success": bool, "message": str} (HTTP 400 when success is false). Acting as
SGLang >= 0.5.20 (ServeConfig.weight_update_sessions), updates from distributed / tensor are refused
outside POST /begin_weight_update ... /end_weight_update, as 0.5.2x does. Broadcast tensors are received
first and validated after (all or nothing): the trainer is broadcasting, and would otherwise block until
the group times out. The wire format of a "flattened_bucket" is megaopd.rollout.weight_wire's.
"""
from __future__ import annotations

import base64
import os
import threading
from typing import Any, Callable

import torch

from megaopd.engine.memory import EngineReleasedError
from megaopd.engine.runner import ModelRunner
from megaopd.engine.weights import WeightMismatchError
from megaopd.parallel import custom_group as dist_group
from megaopd.rollout import weight_wire as wire
from megaopd.rollout.schema import BadRequest
from megaopd.serving.http import require

_LOADED = {"success": True, "message": "Succeeded to update parameter online."}
_FAILED = "Failed to update weights: "  # the client reads this prefix as "received, not loaded"


class WeightUpdates:
    """The weight-update endpoints over one runner: the groups this server joined, and the open session."""

    def __init__(self, engine: Callable[[], ModelRunner], group_timeout_s: float, sessions: bool):
        self._engine = engine
        """The runner, or HttpError 503 while it loads."""
        self.group_timeout_s = group_timeout_s
        self.sessions = sessions
        """Whether updates need a session (acting as SGLang >= 0.5.20)."""
        self.groups: dict[str, dist_group.dist.ProcessGroup] = {}
        self._recv_buffers: dict[str, torch.Tensor] = {}  # group name -> reusable flattened-bucket buffer
        self.session: str | None = None  # selector of the open weight-update session
        self._session_lock = threading.Lock()

    def close(self) -> None:
        for pg in self.groups.values():
            dist_group.destroy_custom_process_group(pg)
        self.groups.clear()

    # ------------------------------------------------------------------------------------ groups
    def init_group(self, req: dict) -> dict:
        self._engine()
        require(req, ("master_address", "master_port", "rank_offset", "world_size"))
        name = req.get("group_name", "weight_update_group")
        backend = req.get("backend", "nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            raise BadRequest("backend 'nccl' needs a GPU; this server runs on the CPU, use backend 'gloo'")
        if name in self.groups:
            raise BadRequest(f"weight update group {name!r} already exists; destroy it first")
        try:
            pg = dist_group.init_custom_process_group(
                backend, str(req["master_address"]), int(req["master_port"]), int(req["rank_offset"]),
                int(req["world_size"]), name, timeout_s=self.group_timeout_s)
        except Exception as e:  # noqa: BLE001 - returned to the caller as SGLang does
            return {"success": False, "message": f"Failed to init group: {type(e).__name__}: {e}"}
        self.groups[name] = pg
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_from_distributed(self, req: dict) -> dict:
        engine = self._engine()
        require(req, ("names", "dtypes", "shapes"))
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
        if fmt is None and device == engine.device:
            # Per-tensor broadcasts land straight in the model's tensors when names, shapes and dtypes
            # all match: no scratch copy (on CPU a copy costs as much as the transfer itself).
            def fill(targets):
                # All receives posted at once, then awaited: no per-tensor round trip.
                for work in [dist_group.broadcast(t, pg, async_op=True) for t in targets]:
                    work.wait()
            try:
                if engine.receive_weights_in_place(list(zip(names, shapes, torch_dtypes)), fill, version):
                    return dict(_LOADED)
            except EngineReleasedError as e:
                self._receive_scratch(pg, None, names, torch_dtypes, shapes, device)  # keep the group in step
                return {"success": False, "message": _FAILED + str(e)}
        # Receive everything first, even when names or shapes are wrong (see the module docstring).
        tensors = self._receive_scratch(pg, fmt, names, torch_dtypes, shapes, device, buffer_key=name)
        try:
            engine.update_weights(tensors, weight_version=version)
        except (WeightMismatchError, EngineReleasedError) as e:
            return {"success": False, "message": _FAILED + str(e)}
        return dict(_LOADED)

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

    def destroy_group(self, req: dict) -> dict:
        name = (req or {}).get("group_name", "weight_update_group")
        pg = self.groups.pop(name, None)
        self._recv_buffers.pop(name, None)
        if pg is None:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        dist_group.destroy_custom_process_group(pg)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    # ------------------------------------------------------------------ other sources of weights
    def update_from_tensor(self, req: Any) -> dict:
        self._engine()
        require(req, ("serialized_named_tensors",))
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
        require(req, ("model_path",))
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

    # ------------------------------------------------------------------- weight-update sessions
    def _session_refusal(self, what: str) -> dict | None:
        """SGLang 0.5.2x's answer to an update outside a session (None: go on)."""
        if self.sessions and self.session is None:
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


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
        return True
    except ValueError:
        return False
