"""Transport "dist_group": the trainer (rank 0) broadcasts HF-named tensors to HTTP engines over a
torch.distributed group, speaking SGLang's /init_weights_update_group + /update_weights_from_distributed.

    updater = DistributedWeightUpdater([engine], DistributedUpdateConfig(master_address="10.0.0.1"))
    updater.connect()                                   # POST /init_weights_update_group from threads,
                                                        # while this process joins as rank 0
    updater.update(hf_named_tensors, weight_version="step-7")   # per bucket: POST the metadata to every
                                                        # engine, broadcast, wait for their answers
    updater.close()

The trainer is rank 0 of a group of 1 + (the engines' workers); per bucket one POST carries
names/dtypes/shapes and then either one broadcast per tensor (load_format None, the gloo default) or
one broadcast of the bucket's bytes ("flattened_bucket", the nccl default; megaopd.rollout.weight_wire).
Tensors are consumed lazily, a bucket ahead, and moved to the group's device (CUDA under nccl) before
they are broadcast. An engine that received a bucket but refused to load it (names/shapes: it lists
them) leaves the group in step: the other buckets still go and one error lists every refusal at the
end. An engine that refused before receiving, closed the group or stopped answering raises at once
instead of leaving the trainer blocked in a broadcast; the group is then abandoned and connect() forms
a new one (under a fresh group name). Likewise an engine that answers it cannot join (a backend it
lacks, a name its process already holds) ends connect()'s rendezvous at once; a taken name is tried
again under the next free one when the port is chosen automatically and no engine is left waiting in the
abandoned rendezvous.

SGLang 0.5.2x refuses updates outside a weight-update session: each update() opens one on every engine
that needs it (HttpEngine.begin_weight_update decides from the server's version) and closes it at the
end, also when the update failed. Engines on their own GPUs or nodes use this transport; colocated
engines cannot (NCCL refuses two ranks of one group on one GPU) and use megaopd.sync.cuda_ipc.

Waits: every POST waits as HttpEngine.request does (megaopd.rollout.waits), so an engine that answers
nothing for its stall_timeout_s ends the join or the update at once with its EngineStalledError (the
rendezvous and the broadcast, which cannot tell, are abandoned with it), and a stop request (the trainer's
preemption flag) ends them with WaitAbandoned; the cleanups that follow (destroying the group, closing the
sessions) are best effort and skip an engine that is gone.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from megaopd.parallel import custom_group as dist_group
from megaopd.parallel.dist import find_free_port
from megaopd.rollout import weight_wire as wire
from megaopd.rollout.client import EngineError, EngineStalledError, HttpEngine
from megaopd.rollout.waits import WaitAbandoned
from megaopd.sync.transport import TransportKind, TransportSetup


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
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        )
        self.load_format = self.config.load_format
        if self.load_format == "auto":
            self.load_format = "flattened_bucket" if self.backend == "nccl" else None
        self.pg = None
        self.group_name = self.config.group_name
        self._abandoned: list = []  # groups left with a pending broadcast; kept alive, never reused
        self._late: list = []  # groups that formed after connect() gave up on them; destroyed from this thread
        self.world_size = 1 + sum(e.config.workers for e in self.engines)

    def connect(self) -> None:
        """Forms the group: every engine joins from a background POST while this process hosts rank 0."""
        if self.pg is not None:
            return
        self._destroy_late()
        # torch registers groups by name per process; after an abandoned group (or beside another
        # updater) take a fresh name. Engines use whatever name the request carries.
        from torch.distributed.distributed_c10d import _world

        refused: set[str] = set()
        for attempt in range(_NAME_TRIES):
            taken, k = set(_world.pg_names.values()) | refused, 1
            self.group_name = self.config.group_name
            while self.group_name in taken:
                self.group_name, k = f"{self.config.group_name}_{k}", k + 1
            try:
                self.pg = self._form(self.config.master_port or find_free_port())
                return
            except _NameTaken as e:
                # An engine's process already holds a group of this name that /destroy_weights_update_group
                # did not drop (another client's, in a process it shares). A fixed port is still held by the
                # abandoned rendezvous, so only an automatic one can try again under another name; and only
                # when every engine has answered: one that joined is blocked in the abandoned rendezvous
                # until it times out, and would take the next request only then.
                if self.config.master_port is not None or attempt == _NAME_TRIES - 1 or not e.settled:
                    raise EngineError(str(e)) from None
                refused.add(self.group_name)

    def _form(self, port: int):
        offsets, offset = [], 1
        for e in self.engines:
            offsets.append(offset)
            offset += e.config.workers
        # A run that ended without close() (killed, preempted, crashed) left its group on engines that outlive
        # it, and SGLang refuses a second group of the same name ("already been created"): drop it first. One
        # run owns an engine's weights, so a group of this name there can only be a dead run's.
        self._destroy_on_engines()
        bodies = [
            {
                "master_address": self.config.master_address,
                "master_port": port,
                "rank_offset": off,
                "world_size": self.world_size,
                "group_name": self.group_name,
                "backend": self.backend,
            }
            for off in offsets
        ]
        calls = self._post_all("/init_weights_update_group", bodies)
        pg = self._host_group(port, calls)
        errors = _join(calls, self.config.timeout_s)
        if errors:
            # Under nccl rank 0's group forms once every rank has reached the store, before an engine that then
            # refuses the name has answered: the refusal arrives here.
            dist_group.destroy_custom_process_group(pg)
            self._destroy_on_engines()  # the engines that did join hold the group under this name
            _raise_gone(calls)
            raise _refusal(f"engines failed to join the weight-update group: {errors}", errors, calls)
        return pg

    def _host_group(self, port: int, calls: list["_Call"]):
        """Hosts rank 0 while the engines join. An engine that answers it could not join (a refused name, a
        backend it lacks) ends the wait at once: the group cannot form, and the blocking rendezvous would
        otherwise hold this rank for its whole timeout (600 s by default) with nothing said. The rendezvous
        thread is left to time out by itself (a daemon thread; should the group form after all, the next
        connect() or close() destroys it, from the caller's thread); the next try takes a fresh name and port."""
        out: dict[str, Any] = {}
        lock = threading.Lock()  # hands the group over: to connect(), or to self._late once connect() gave up

        def host():
            try:
                if self.device.type == "cuda":  # a new thread starts on device 0; nccl binds the current one
                    torch.cuda.set_device(self.device)
                pg = dist_group.init_custom_process_group(
                    self.backend,
                    self.config.master_address,
                    port,
                    0,
                    self.world_size,
                    self.group_name,
                    timeout_s=self.config.timeout_s,
                )
            except Exception as e:  # noqa: BLE001 - raised below, with what the engines said
                out["error"] = e
                return
            with lock:
                if out.get("given_up"):
                    self._late.append(pg)
                else:
                    out["pg"] = pg

        def give_up():
            with lock:
                out["given_up"] = True
                formed = out.pop("pg", None)
            if formed is not None:
                dist_group.destroy_custom_process_group(formed)

        where = (
            f"weight-update group {self.group_name!r} on {self.config.master_address}:{port} "
            f"(world size {self.world_size})"
        )
        hosting = threading.Thread(target=host, daemon=True, name="megaopd-weight-group")
        hosting.start()
        while hosting.is_alive():
            hosting.join(0.2)
            errors = _finished_errors(calls)
            if errors and hosting.is_alive():
                give_up()
                _raise_gone(calls)  # stalled or abandoned: nothing more to wait for
                # The other engines' answers follow within moments when they refused too (the usual case: all
                # share the cause); one still blocked has joined, and is stuck in this rendezvous.
                _join(calls, _SETTLE_S)
                errors = _finished_errors(calls)
                raise _refusal(f"{where} cannot form: engines refused to join: {errors}", errors, calls)
        if "error" in out:
            errors = _finished_errors(calls)
            raise EngineError(
                f"{where} did not form: {out['error']}" + (f"; engines said: {errors}" if errors else "")
            ) from out["error"]
        return out["pg"]

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> None:
        """Broadcasts full HF-named tensors to every engine, bucket by bucket, in the given order, inside
        each engine's weight-update session where its SGLang version needs one."""
        if self.pg is None:
            self.connect()
        with weight_update_sessions(self.engines):
            self._update(named_tensors, weight_version)

    def _update(self, named_tensors, weight_version) -> None:
        # Buckets are taken lazily, one ahead (to know which is last): a trainer's generator that gathers
        # TP/PP shards per tensor is consumed while earlier buckets are on the wire, never all at once.
        bucket_iter = wire.buckets(named_tensors, self.config.bucket_bytes)
        refused: list[str] = []
        flattened = self.load_format == "flattened_bucket"

        def prepared(bucket):
            tensors = [t.detach().to(self.device) for _, t in bucket]
            return bucket, tensors, (wire.flatten_bucket(tensors) if flattened else None)

        nxt = next(bucket_iter, None)
        nxt = prepared(nxt) if nxt is not None else None
        k = 0
        while nxt is not None:
            bucket, tensors, flat = nxt
            k += 1
            following = next(bucket_iter, None)
            last = following is None
            names = [n for n, _ in bucket]
            body = {
                "names": names,
                "dtypes": [wire.dtype_name(t.dtype) for t in tensors],
                "shapes": [list(t.shape) for t in tensors],
                "group_name": self.group_name,
                "flush_cache": self.config.flush_cache and last,
                "load_format": self.load_format,
                # The version flips with the last bucket, so it never names half-loaded weights.
                "weight_version": weight_version if last else None,
            }
            calls = self._post_all("/update_weights_from_distributed", [body] * len(self.engines))
            if flattened:
                works = [dist_group.broadcast(flat, self.pg, async_op=True)]
            else:
                works = [dist_group.broadcast(t.contiguous(), self.pg, async_op=True) for t in tensors]
            # Pack the next bucket while this one is on the wire (on a CPU the copy costs about as much).
            nxt = None if last else prepared(following)
            self._wait_broadcast(works, calls)
            errors = _join(calls, self.config.timeout_s)
            if any(getattr(c, "exc", None) is not None for c in calls):
                self._abandon()
                _raise_gone(calls)
            if errors and not all(any(m in e for m in _AFTER_RECEIPT) for e in errors):
                # Refused before receiving (unknown group, bad request): a small broadcast may have
                # completed into socket buffers, but the group is out of step now.
                self._abandon()
                raise EngineError(
                    f"weight update refused (bucket {k}): {errors}; "
                    "the weight-update group is abandoned, connect() again"
                )
            if errors:
                # The engines received the bucket and refused to load it (names/shapes): the group is
                # still in step, so go on and report every refused bucket at the end.
                refused.append(f"bucket {k} ({len(names)} tensors): " + "; ".join(errors))
        if refused:
            raise EngineError(
                f"weight update refused for {len(refused)} of {k} bucket(s) (each "
                "refused bucket loaded nothing; accepted ones were loaded):\n" + "\n".join(refused)
            )

    def _wait_broadcast(self, works, calls) -> None:
        # Poll instead of work.wait(): an engine that refused before receiving leaves the broadcast
        # pending until the group times out; its HTTP answer tells us to stop waiting now.
        deadline = time.monotonic() + self.config.timeout_s
        pause = 1e-4
        while not all(w.is_completed() for w in works):
            errors = _finished_errors(calls)
            if errors:
                self._abandon()
                _raise_gone(calls)
                raise EngineError(
                    f"weight update refused before the broadcast completed: {errors}; "
                    "the weight-update group is abandoned, connect() again"
                )
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
            raise EngineError(
                f"weight broadcast failed: {e}; engines said: {errors}; "
                "the weight-update group is abandoned, connect() again"
            ) from e

    def _abandon(self) -> None:
        # A broadcast is left pending on the group: keep the object alive (destroying it under a pending
        # op can hang) and never use it again; tell the engines to drop their side.
        self._abandoned.append(self.pg)
        self.pg = None
        self._destroy_on_engines()

    def _destroy_on_engines(self) -> None:
        for e in self.engines:
            try:
                e.request(
                    "POST", "/destroy_weights_update_group", {"group_name": self.group_name}, retries=0, timeout_s=10.0
                )
            except (EngineError, WaitAbandoned):  # best effort: the engine may be gone, or we are leaving
                pass

    def _destroy_late(self) -> None:
        while self._late:
            dist_group.destroy_custom_process_group(self._late.pop())

    def close(self) -> None:
        """Destroys the group on the engines and here (best effort: engines may be gone)."""
        self._destroy_late()
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


class weight_update_sessions:
    """Opens SGLang's weight-update session on every engine that needs one, closes them on exit (also
    after an error: a session left open makes the next begin fail)."""

    def __init__(self, engines: list[HttpEngine], selector: str = "all"):
        self.engines, self.selector, self.opened = engines, selector, []

    def __enter__(self):
        try:
            for e in self.engines:
                if e.begin_weight_update(self.selector):
                    self.opened.append(e)
        except BaseException:
            self._close(raise_errors=False)
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        self._close(raise_errors=exc_type is None)
        return False

    def _close(self, raise_errors: bool) -> None:
        errors, abandoned = [], None
        for e in self.opened:
            try:
                e.end_weight_update()
            except EngineError as err:
                errors.append(str(err))
            except WaitAbandoned as err:  # the trainer is leaving (preemption): the others are skipped too
                abandoned = err
        self.opened = []
        if abandoned is not None and raise_errors:
            raise abandoned
        if errors and raise_errors:
            raise EngineError("could not close the weight-update session: " + "; ".join(errors))


# Engine messages for a bucket that was received and then not loaded (megaopd serve; SGLang's load
# failure): the group is still in step. Any other refusal abandons the group.
_AFTER_RECEIPT = ("Failed to update weights", "Failed to update parameter online")


_NAME_TRIES = 3
_NAME_IN_USE = ("already been created", "already exists")  # torch's words (SGLang passes them on); ours


_SETTLE_S = 2.0  # after one refusal, how long the other engines' answers are awaited


class _NameTaken(EngineError):
    """An engine refused the group's name: a process-wide name there is taken (torch's "already been created")."""

    def __init__(self, message: str, settled: bool):
        super().__init__(message)
        self.settled = settled
        """Every engine has answered (none is left blocked in the rendezvous): a retry reaches them all."""


class _Call(threading.Thread):
    """One POST in a background thread (group formation and updates block until the trainer acts)."""

    def __init__(self, engine: HttpEngine, path: str, body: dict, timeout_s: float):
        super().__init__(daemon=True, name=f"megaopd-post{path}")
        self.engine, self.path, self.body, self.timeout_s = engine, path, body, timeout_s
        self.result: Any = None
        self.error: str | None = None
        self.exc: EngineStalledError | WaitAbandoned | None = None
        """The engine fell silent, or the wait was given up: the group cannot go on, whatever the others say."""

    def run(self):
        try:
            # No retries: these calls are not idempotent (a second join or receive would desynchronize).
            self.result = self.engine.request("POST", self.path, self.body, timeout_s=self.timeout_s, retries=0)
            if isinstance(self.result, dict) and self.result.get("success") is False:
                self.error = str(self.result.get("message"))
        except (EngineStalledError, WaitAbandoned) as e:
            self.exc, self.error = e, str(e)
        except EngineError as e:
            self.error = str(e)


def _refusal(message: str, errors: list[str], calls: list[_Call]) -> EngineError:
    """The error for engines that refused to join: _NameTaken when one refused the group's name."""
    if any(m in e for e in errors for m in _NAME_IN_USE):
        return _NameTaken(message, settled=not any(c.is_alive() for c in calls))
    return EngineError(message)


def _raise_gone(calls: list[_Call]) -> None:
    """Raises a call's WaitAbandoned (first: the trainer is leaving) or EngineStalledError as it is."""
    gone = [c.exc for c in calls if getattr(c, "exc", None) is not None]
    gone.sort(key=lambda e: not isinstance(e, WaitAbandoned))
    if gone:
        raise gone[0]


def _finished_errors(calls: list[_Call]) -> list[str]:
    return [f"{c.engine.url}: {c.error}" for c in calls if not c.is_alive() and c.error]


def _join(calls: list[_Call], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    for c in calls:
        c.join(timeout=max(0.0, deadline - time.monotonic()))
    errors = _finished_errors(calls)
    errors += [f"{c.engine.url}: no answer in {timeout_s:.0f}s" for c in calls if c.is_alive()]
    return errors


class DistGroupTransport:
    """Transport "dist_group" for the WeightSync: one group (one broadcast) reaches every engine given."""

    name = "dist_group"
    all_ranks = False
    """Only trainer rank 0 sends (the gather already brought every tensor there)."""

    def __init__(self, engines: list[HttpEngine], config: DistributedUpdateConfig | None = None):
        self.updater = DistributedWeightUpdater(engines, config)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        if self.updater.pg is None:  # first push, or the last group was abandoned after a failure
            self.updater.connect()
        self.updater.update(named_tensors, weight_version=weight_version)

    def close(self) -> None:
        self.updater.close()


def _build(setup: TransportSetup) -> DistGroupTransport:
    r = setup.rollout
    return DistGroupTransport(
        setup.targets,
        DistributedUpdateConfig(
            master_address=r.weight_sync_address, bucket_bytes=setup.bucket_bytes, timeout_s=r.request_timeout_s
        ),
    )


KIND = TransportKind("dist_group", _build, colocated=False)
"""Engines on their own GPUs (NCCL refuses a group with two ranks on one GPU)."""
