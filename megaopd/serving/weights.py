"""Weight updates of `megaopd serve`, as SGLang answers them: weight-update groups (join the trainer's
group, receive its broadcasts, leave), loads from a directory, and the 0.5.2x session protocol.

Every endpoint answers {"success": bool, "message": str} (HTTP 400 when success is false). Acting as
SGLang >= 0.5.20 (ServeConfig.weight_update_sessions), updates from distributed / tensor are refused
outside POST /begin_weight_update ... /end_weight_update, as 0.5.2x does. Broadcast tensors are received
first and validated after (all or nothing): the trainer is broadcasting, and would otherwise block until
the group times out. The wire format of a "flattened_bucket" is megaopd.rollout.weight_wire's.

What an update may do (serving.access; refused with HTTP 403 naming the flag that allows it):
/update_weights_from_disk reads only under the allowed folders (the served model's and each
--allowed-weight-root, symlinks and `..` resolved), /init_weights_update_group connects only to allowed
hosts (loopback and each --allowed-sync-host). Weights holding NaN or inf are not loaded (HTTP 400); those
that arrive by the zero-copy path are already in the model when they are checked, so the update fails and
/generate is refused (HTTP 400 naming the tensors) until they are loaded again with finite values.
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
from megaopd.serving.access import AccessDenied, SyncHosts, WeightRoots
from megaopd.serving.http import HttpError, require

_LOADED = {"success": True, "message": "Succeeded to update parameter online."}
_FAILED = "Failed to update weights: "  # the client reads this prefix as "received, not loaded"


class WeightUpdates:
    """The weight-update endpoints over one runner: the groups this server joined, and the open session."""

    def __init__(
        self,
        engine: Callable[[], ModelRunner],
        group_timeout_s: float,
        sessions: bool,
        roots: WeightRoots,
        hosts: SyncHosts,
    ):
        self._engine = engine
        """The runner, or HttpError 503 while it loads."""
        self.roots, self.hosts = roots, hosts
        """Where /update_weights_from_disk may read, whom /init_weights_update_group may join."""
        self.nonfinite: set[str] = set()
        """Weights the zero-copy path loaded with NaN / inf in them (see the module docstring)."""
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
        port, offset, world = int(req["master_port"]), int(req["rank_offset"]), int(req["world_size"])
        if not (0 < port < 65536 and 0 < offset < world):
            raise BadRequest(
                f"master_port={port} must be in 1..65535 and rank_offset={offset} in 1..world_size-1 "
                f"(world_size={world}: the trainer is rank 0)"
            )
        address = _allowed(self.hosts.check, str(req["master_address"]))
        try:
            pg = dist_group.init_custom_process_group(
                backend, address, port, offset, world, name, timeout_s=self.group_timeout_s
            )
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
            return {
                "success": False,
                "message": f"Failed to receive weights: Group {name} not in "
                f"{list(self.groups)}. Please call `init_weights_update_group` first.",
            }
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
                bad.extend(n for n, t in zip(names, targets) if not finite(t))

            bad: list[str] = []
            try:
                if engine.receive_weights_in_place(list(zip(names, shapes, torch_dtypes)), fill, version):
                    self.nonfinite.difference_update(names)
                    self.nonfinite.update(bad)
                    return (
                        {"success": False, "message": _FAILED + _nonfinite_message(bad, loaded=True)}
                        if bad
                        else dict(_LOADED)
                    )
            except EngineReleasedError as e:
                self._receive_scratch(pg, None, names, torch_dtypes, shapes, device)  # keep the group in step
                return {"success": False, "message": _FAILED + str(e)}
        # Receive everything first, even when names or shapes are wrong (see the module docstring).
        tensors = self._receive_scratch(pg, fmt, names, torch_dtypes, shapes, device, buffer_key=name)
        bad = [n for n, t in tensors if not finite(t)]
        if bad:
            return {"success": False, "message": _FAILED + _nonfinite_message(bad, loaded=False)}
        try:
            engine.update_weights(tensors, weight_version=version)
        except (WeightMismatchError, EngineReleasedError) as e:
            return {"success": False, "message": _FAILED + str(e)}
        self.nonfinite.difference_update(names)
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
        return {
            "success": False,
            "message": "megaopd serve does not load CUDA IPC handles "
            "(/update_weights_from_tensor needs SGLang on the trainer's GPUs)",
        }

    def update_from_disk(self, req: dict) -> dict:
        from safetensors.torch import load_file

        engine = self._engine()
        require(req, ("model_path",))
        path = req["model_path"]
        if not isinstance(path, str):
            raise BadRequest(f"model_path must be a string, got {type(path).__name__}", kind="schema")
        real = _allowed(self.roots.check, path)
        files = sorted(f for f in os.listdir(real) if f.endswith(".safetensors")) if os.path.isdir(real) else []
        if not files:
            return {
                "success": False,
                "message": f"Failed to get weights iterator: Cannot find any model weights with `{path}`.",
                "num_paused_requests": 0,
            }
        tensors = {}
        for f in files:  # each file checked too: a symlink inside an allowed folder may point out of it
            tensors.update(load_file(_allowed(self.roots.check, os.path.join(real, f))))
        bad = [n for n, t in tensors.items() if not finite(t)]
        if bad:
            return {
                "success": False,
                "message": _FAILED + _nonfinite_message(bad, loaded=False),
                "num_paused_requests": 0,
            }
        try:
            engine.update_weights(tensors.items(), weight_version=req.get("weight_version"))
        except WeightMismatchError as e:
            return {"success": False, "message": f"Failed to update weights: {e}", "num_paused_requests": 0}
        self.nonfinite.difference_update(tensors)
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def load_lora_adapter(self, req: dict) -> dict:
        """POST /load_lora_adapter: a peft adapter merged into the served base (ModelRunner.update_adapter:
        W_base + (alpha / r) B A in float32; the previous adapter's weights return to the base); lora_name becomes
        the weight version. The adapter comes one of two ways, never both:
          - lora_path (SGLang's field): a peft folder (adapter_config.json, adapter_model.safetensors) under the
            allowed folders, each file checked against the roots too (a symlink may point out);
          - adapter_config (the JSON object of adapter_config.json) and adapter_model (the bytes of
            adapter_model.safetensors, base64): the two files in the request, as the trainer's adapter sync
            sends them (megaopd.sync.http_lora); safetensors only (nothing loaded runs code).
        The key and the body limit are those of every request; the same checks follow either way; all or
        nothing."""
        import json

        from safetensors import SafetensorError
        from safetensors.torch import load, load_file

        from megaopd.models.hf_io import PEFT_CONFIG, PEFT_WEIGHTS

        engine = self._engine()
        require(req, ("lora_name",))
        name, path = req["lora_name"], req.get("lora_path")
        inline = "adapter_config" in req or "adapter_model" in req
        if not isinstance(name, str):
            raise BadRequest("lora_name must be a string", kind="schema")
        if inline == (path is not None):
            raise BadRequest(
                "give either lora_path (a peft folder) or adapter_config with adapter_model (its files), not "
                + ("both" if inline else "neither")
            )
        if inline:
            config, weights = req.get("adapter_config"), req.get("adapter_model")
            if not isinstance(weights, str) or not _is_base64(weights):
                raise BadRequest("adapter_model: base64 of an adapter_model.safetensors file", kind="schema")
            where = f"adapter {name!r}"
            try:
                tensors = load(base64.b64decode(weights))
            except (SafetensorError, ValueError) as e:
                return {"success": False, "message": f"{where}: adapter_model is not a safetensors file: {e}"}
            return self._load_adapter(engine, name, where, config, tensors)
        if not isinstance(path, str):
            raise BadRequest("lora_path must be a string", kind="schema")
        real = _allowed(self.roots.check, path)
        files = [os.path.join(real, f) for f in (PEFT_CONFIG, PEFT_WEIGHTS)]
        if not all(os.path.isfile(f) for f in files):
            return {"success": False, "message": f"{path} is not a peft adapter folder ({PEFT_CONFIG}, {PEFT_WEIGHTS})"}
        config_file, weights_file = (_allowed(self.roots.check, f) for f in files)
        try:
            with open(config_file) as f:
                config = json.load(f)
            tensors = load_file(weights_file)
        except (OSError, ValueError, SafetensorError) as e:
            return {"success": False, "message": f"{path}: unreadable adapter: {e}"}
        return self._load_adapter(engine, name, path, config, tensors)

    @staticmethod
    def _load_adapter(engine: ModelRunner, name: str, where: str, config: Any, tensors: dict) -> dict:
        """The checks either source of /load_lora_adapter passes, then the merge (all or nothing)."""
        from megaopd.engine.lora import AdapterError, AdapterUpdate
        from megaopd.models.hf_io import PEFT_CONFIG

        if not isinstance(config, dict):
            return {"success": False, "message": f"{where}: {PEFT_CONFIG} must hold a JSON object"}
        rank, alpha = config.get("r"), config.get("lora_alpha")
        if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
            return {"success": False, "message": f"{where}: only plain LoRA adapters load (not DoRA, rsLoRA)"}
        if not isinstance(rank, int) or isinstance(rank, bool) or not isinstance(alpha, (int, float)):
            return {"success": False, "message": f"{where}: {PEFT_CONFIG} needs an integer r and a number lora_alpha"}
        try:
            engine.update_adapter(AdapterUpdate.of(tensors.items(), rank, float(alpha), name))
        except (AdapterError, WeightMismatchError, EngineReleasedError) as e:
            return {"success": False, "message": _FAILED + " ".join(str(e).split())}
        return {"success": True, "message": f"Succeeded to load LoRA adapter {name}."}

    def generation_refusal(self) -> str | None:
        """Why /generate is refused now (weights with NaN / inf loaded), or None."""
        return _nonfinite_message(sorted(self.nonfinite), loaded=True) if self.nonfinite else None

    # ------------------------------------------------------------------- weight-update sessions
    def _session_refusal(self, what: str) -> dict | None:
        """SGLang 0.5.2x's answer to an update outside a session (None: go on)."""
        if self.sessions and self.session is None:
            return {
                "success": False,
                "message": f"{what} must run between begin_weight_update() and end_weight_update()",
            }
        return None

    def begin_weight_update(self, req: Any) -> dict:
        selector = (req or {}).get("selector", "all") if isinstance(req, (dict, type(None))) else None
        if selector not in ("target", "draft", "all"):
            raise BadRequest(f"selector={selector!r}: Input should be 'target', 'draft' or 'all'", kind="schema")
        with self._session_lock:
            if self.session is not None:
                return {
                    "success": False,
                    "message": "a weight-update session is already open; call end_weight_update() first",
                }
            self.session = selector
        return {"success": True, "message": "Success"}

    def end_weight_update(self, _req: Any) -> dict:
        with self._session_lock:
            if self.session is None:
                return {
                    "success": False,
                    "message": "no weight-update session is open; call begin_weight_update() first",
                }
            self.session = None
        return {"success": True, "message": "Success"}


def finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN / inf: one float64 sum (a NaN or inf anywhere makes it non-finite, and
    float64 cannot overflow on float32 / bf16 weights) instead of a tensor-sized mask."""
    return not t.is_floating_point() or bool(torch.isfinite(t.sum(dtype=torch.float64)))


def _nonfinite_message(names: list[str], loaded: bool) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    if loaded:
        return (
            f"non-finite values (NaN/inf) in {shown}: loaded by the zero-copy path, so /generate is refused "
            "until they are loaded again with finite values"
        )
    return f"non-finite values (NaN/inf) in {shown}: nothing was loaded"


def _allowed(check: Callable[[str], str], value: str) -> str:
    """check(value), its AccessDenied answered as HTTP 403 in SGLang's {success, message} form."""
    try:
        return check(value)
    except AccessDenied as e:
        raise HttpError(403, {"success": False, "message": str(e)}) from None


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
        return True
    except ValueError:
        return False
