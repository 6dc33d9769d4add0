"""Transport "cuda_ipc": colocated engines receive CUDA IPC handles through SGLang's
/update_weights_from_tensor, from the trainer ranks on their own GPUs.

Why not the weight-update group: a colocated engine's TP rank r runs on the GPU of a trainer rank,
and NCCL refuses a group holding two ranks on one GPU ("Duplicate GPU detected"). So, as slime does
for colocation, each trainer rank that shares a GPU with an engine rank hands it the tensors by CUDA
IPC handle: no copy between processes, no group.

Per bucket (every trainer rank runs this; `feeders[i][r]` is the trainer rank on engine i's TP rank
r's GPU):
    every feeder      serialize_named_tensors(bucket on its GPU) -> base64 text of torch's
                      ForkingPickler (a CUDA tensor pickles as an IPC handle)
    gather_object     the texts to trainer rank 0 of `group`
    rank 0            POST /update_weights_from_tensor {serialized_named_tensors: [text of TP rank 0,
                      of TP rank 1, ...], load_format: null, flush_cache, weight_version} to each
                      engine (inside its weight-update session when its SGLang version needs one)
    broadcast_object  the engines' errors from rank 0: every rank raises together or goes on; the
                      bucket's tensors stay alive until then (the engine has copied them by now)

Where engines sit: engine i (in rollout.urls order) is on node i // engines_per_node and its TP rank r
on local GPU base_gpu_id + r; trainer rank g is on node g // local_world_size, local GPU
g % local_world_size (torchrun's order). feeder_ranks() computes the map, and refuses layouts where
an engine rank has no trainer rank on its GPU.

On a CPU machine the transport cannot run for real (CUDA IPC needs GPUs; SGLang's CPU build refuses
nothing but has no handles to open); the payloads it builds are unit-tested (tests/sync/test_transports.py),
SGLang 0.5.23 accepts their format (tests/e2e/sglang), and the GPU check script runs it.
"""

from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler
from torch.multiprocessing import reductions

from megaopd.rollout import weight_wire as wire
from megaopd.rollout.client import EngineError, HttpEngine
from megaopd.rollout.waits import WaitAbandoned
from megaopd.sync.distributed import weight_update_sessions
from megaopd.sync.transport import TransportKind, TransportSetup

_DEVICE_ARG = 6
"""Index of the CUDA device in the arguments torch's reduce_tensor gives a CUDA tensor (SGLang's patch
reads the same slot: _REDUCE_TENSOR_ARG_DEVICE_INDEX in sglang.srt.utils.patch_torch)."""


def _reduce_tensor_by_uuid(tensor: torch.Tensor):
    """torch's reduction of a tensor, its CUDA device named by UUID instead of index. SGLang's engines rebuild
    IPC tensors with their patched rebuild_cuda_tensor, which reads either (a UUID cannot pick the wrong GPU
    under another CUDA_VISIBLE_DEVICES order). CPU tensors keep torch's own reduction untouched."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])
    return rebuild, args


class _IpcPickler(ForkingPickler):
    """ForkingPickler whose tensors name their GPU by UUID. A private dispatch table instead of SGLang's
    monkey_patch_torch_reductions: that patch replaces torch's reduce_tensor for the whole process and
    assumes every tensor is a CUDA one, so afterwards pickling any CPU tensor through torch.multiprocessing
    (spawned workers' queues, data loaders) fails with IndexError; this pickler changes nothing else."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dispatch_table = {
            cls: (_reduce_tensor_by_uuid if fn is reductions.reduce_tensor else fn)
            for cls, fn in self.dispatch_table.items()
        }


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """SGLang's MultiprocessingSerializer format with output_str: base64 of a ForkingPickler dump of
    [(name, tensor), ...]. CUDA tensors become IPC handles (device by UUID): keep them alive until the
    engine loaded them."""
    buf = io.BytesIO()
    _IpcPickler(buf, pickle.HIGHEST_PROTOCOL).dump([(str(n), t) for n, t in named])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(text: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of serialize_named_tensors, for tests and engines of this process's trust: it unpickles."""
    return pickle.loads(base64.b64decode(text))


def tensor_request(serialized_per_tp_rank: list[str], flush_cache: bool, weight_version: str | None) -> dict:
    """The /update_weights_from_tensor body: one serialized list per engine TP rank, in TP rank order."""
    return {
        "serialized_named_tensors": list(serialized_per_tp_rank),
        "load_format": None,
        "flush_cache": bool(flush_cache),
        "weight_version": weight_version,
    }


@dataclass(frozen=True)
class IpcLayout:
    """Where colocated engines and trainer ranks sit (see the module docstring)."""

    local_world_size: int
    """Trainer ranks (= GPUs) per node."""
    world_size: int
    """Trainer ranks in the group that pushes."""
    engines_per_node: int = 1
    """Engines sharing one node, in rollout.urls order (each with its own base_gpu_id)."""

    def __post_init__(self):
        if self.local_world_size < 1 or self.world_size < 1 or self.engines_per_node < 1:
            raise ValueError(f"IpcLayout needs positive sizes, got {self}")


def feeder_ranks(engine_gpus: Sequence[tuple[int, int]], layout: IpcLayout) -> list[list[int]]:
    """feeders[i][r]: the trainer rank on the GPU of engine i's TP rank r.

    engine_gpus[i] = (base_gpu_id, tp_size) of engine i. ValueError when an engine rank falls outside
    its node's GPUs or outside the job's ranks (the engine is not colocated with this trainer).
    """
    feeders = []
    for i, (base, tp) in enumerate(engine_gpus):
        node = i // layout.engines_per_node
        if base < 0 or base + tp > layout.local_world_size:
            raise ValueError(
                f"colocated engine {i}: GPUs {base}..{base + tp - 1} (base_gpu_id {base}, tp {tp}) "
                f"are not all among the node's {layout.local_world_size} trainer GPUs"
            )
        ranks = [node * layout.local_world_size + base + r for r in range(tp)]
        if ranks[-1] >= layout.world_size:
            raise ValueError(
                f"colocated engine {i} would sit on node {node}, but the trainer has only "
                f"{layout.world_size // layout.local_world_size} node(s): list one engine per "
                "trainer node in rollout.urls, or set rollout.colocated=false"
            )
        feeders.append(ranks)
    return feeders


class CudaIpcTransport:
    """Every trainer rank calls push() with the same tensors (the gather gives every rank all of them)."""

    name = "cuda_ipc"
    all_ranks = True

    def __init__(
        self,
        engines: list[HttpEngine] | None,
        feeders: list[list[int]],
        rank: int,
        group=None,
        bucket_bytes: int = 512 << 20,
        device: torch.device | None = None,
    ):
        """engines: the engines on rank 0, None elsewhere. feeders: feeder_ranks(...) (the same on all
        ranks). device: where a feeder's tensors must live for a handle to mean anything (its GPU)."""
        self.engines = list(engines) if engines is not None else None
        self.feeders = [list(f) for f in feeders]
        self.rank, self.group, self.bucket_bytes = rank, group, bucket_bytes
        self.my_slots = [(i, r) for i, ranks in enumerate(self.feeders) for r, g in enumerate(ranks) if g == rank]
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            )
        self.device = device
        if rank == 0 and (self.engines is None or len(self.engines) != len(self.feeders)):
            raise ValueError(f"CudaIpcTransport on rank 0 needs the {len(self.feeders)} engine(s) the feeders name")

    def payload(self, bucket: list[tuple[str, torch.Tensor]]) -> str | None:
        """This rank's serialized bucket when it feeds an engine rank, else None. One text serves all of
        this rank's slots: every engine TP rank loads the full HF tensors and keeps its own shard."""
        if not self.my_slots:
            return None
        return serialize_named_tensors([(n, t.detach().to(self.device).contiguous()) for n, t in bucket])

    def requests(self, payloads: Sequence[str | None], last: bool, weight_version: str | None) -> list[dict]:
        """Rank 0: one /update_weights_from_tensor body per engine from the gathered payloads (by trainer rank)."""
        bodies = []
        for i, ranks in enumerate(self.feeders):
            missing = [g for g in ranks if payloads[g] is None]
            if missing:
                raise RuntimeError(f"engine {i}: trainer ranks {missing} sent no tensors (feeder map out of step)")
            bodies.append(
                tensor_request(
                    [payloads[g] for g in ranks], flush_cache=last, weight_version=weight_version if last else None
                )
            )
        return bodies

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        if self.device.type != "cuda":
            # A CPU tensor pickles as a file descriptor shared through this process's resource sharer, which
            # the engine cannot authenticate to: SGLang 0.5.23's server exits on such a payload (seen on CPU).
            raise ValueError(
                f"the cuda_ipc transport sends CUDA tensors only (device {self.device}): colocated "
                "engines need the trainer on GPUs; set rollout.colocated=false (a weight-update group)"
            )
        world = dist.get_world_size(self.group)
        sessions = weight_update_sessions(self.engines) if self.rank == 0 else None
        abandoned = None  # rank 0: a wait given up (preemption signal); every rank learns it at the next bucket
        if sessions is not None:
            try:
                sessions.__enter__()
            except WaitAbandoned as e:
                abandoned, sessions = e, None
        failed = None
        try:
            bucket_iter = wire.buckets(named_tensors, self.bucket_bytes)
            bucket = next(bucket_iter, None)
            k = 0
            while bucket is not None:
                k += 1
                following = next(bucket_iter, None)  # the same bucket boundaries on every rank
                mine = self.payload(bucket)
                gathered = [None] * world if self.rank == 0 else None
                dist.gather_object(mine, gathered, group=self.group, group_dst=0)
                errors: list[str] = []
                if self.rank == 0 and abandoned is None:
                    for engine, body in zip(self.engines, self.requests(gathered, following is None, weight_version)):
                        try:
                            out = engine.request(
                                "POST",
                                "/update_weights_from_tensor",
                                body,
                                retries=0,
                                timeout_s=engine.config.generate_timeout_s,
                            )
                            if isinstance(out, dict) and out.get("success") is False:
                                errors.append(f"{engine.url}: {out.get('message')}")
                        except EngineError as e:
                            errors.append(str(e))
                        except WaitAbandoned as e:
                            abandoned = e
                            break
                box = [(errors, abandoned is not None)]
                # Also the point after which every rank may free this bucket: the engines are done with it.
                dist.broadcast_object_list(box, group=self.group, group_src=0)
                errors, gone = box[0]
                if gone:  # every rank, here: the caller (WeightSync) drains the gather and goes on together
                    raise abandoned or WaitAbandoned(f"weight sync (cuda_ipc, bucket {k}): abandoned on rank 0")
                if errors:
                    raise EngineError(f"/update_weights_from_tensor refused bucket {k}: " + "; ".join(errors))
                del mine, bucket
                bucket = following
        except BaseException as e:
            failed = e
            raise
        finally:
            if sessions is not None:
                sessions.__exit__(type(failed) if failed else None, failed, None)

    def close(self) -> None:
        pass


def _feeders(targets: list, layout: IpcLayout) -> list[list[int]]:
    return feeder_ranks([(e.config.base_gpu_id, e.config.workers) for e in targets], layout)


def _build(setup: TransportSetup) -> CudaIpcTransport:
    return CudaIpcTransport(setup.targets, setup.decision, setup.rank, setup.group, bucket_bytes=setup.bucket_bytes)


KIND = TransportKind("cuda_ipc", _build, colocated=True, all_ranks=True, alone=True, decide=_feeders)
"""Colocated engines: every trainer rank on an engine's GPU hands it IPC handles (the feeders, decided on rank 0)."""
