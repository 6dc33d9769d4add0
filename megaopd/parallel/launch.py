"""Run one function on a job's ranks: the launcher's (torchrun/srun), or local gloo workers.

    results = run_on_ranks(fn, world_size=2, args=(a, b))   # what every CLI tool and `megaopd train` use
    results = spawn(fn, world_size=2, args=(a, b))          # always local workers (tests)

Each worker gets RANK/WORLD_SIZE/MASTER_* in its environment and an initialized default process group
(gloo + megatron CPU compatibility on CPU). The return values come back in rank order; an exception in
any worker is re-raised here with that worker's traceback, and no worker outlives the timeout.

How local workers start: every worker imports torch, megatron-core and transformers, ~10 s of a small CPU's
time (megatron-core alone ~8). On a machine without CUDA they are forked from a server process that imported
them once (multiprocessing's forkserver, started at this process's first spawn; megaopd.parallel._preload):
a test session or a tool that starts workers many times pays the imports once, and each start takes ~0.1 s
instead of ~10. A forked worker's environment is this process's at the call (plus `env`), as a spawned one's;
its stdout and stderr are this process's when the server started. Workers start fresh (the spawn method), as
before, where:
- CUDA is present: a process forked after CUDA is initialized cannot use it;
- a variable read while modules import or a process starts (IMPORT_TIME_ENV: TRITON_*, MALLOC_*, OMP_*, HF_*,
  TORCH_*, ...) differs from the server's: what the server imported would not see it;
- signals are forwarded (`megaopd train`: SIGTERM / SIGUSR1 from Slurm or `timeout`). Such a signal often
  reaches the whole process group, the server included, and workers whose server died look dead to
  multiprocessing while they are still saving their checkpoint;
- MEGAOPD_START_METHOD=spawn.
A spawned worker that finished runs its exit handlers and leaves with os._exit, as a forked one does: the
interpreter's teardown of torch, megatron-core and transformers would hold the caller's join ~2.5 s.
"""

from __future__ import annotations

import os
import pickle
import traceback
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp

from megaopd.parallel.dist import find_free_port


class WorkerError(RuntimeError):
    """A spawned worker raised; the message holds its rank and traceback. rank: the first rank that failed (None
    when no worker reported: a timeout, or workers that died without a word); summary: its exception in one
    line ("ValueError: ..."), what a command prints, the traceback going to a log (`megaopd train`:
    RUN/logs/rank_R.err); details: the traceback."""

    def __init__(self, message: str, rank: int | None = None, summary: str = "", details: str = ""):
        super().__init__(message)
        self.rank, self.summary, self.details = rank, summary or message.splitlines()[0], details


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and message (a message's own line breaks become spaces). Wrappers
    that carry every rank's traceback in their message (torch.distributed.checkpoint's CheckpointException,
    which megatron's dist_checkpointing raises on a failed load or save) are unwrapped to the first failed rank's
    exception, with the ranks that failed: `ValueError: ... (checkpoint ranks [0, 1])`; the whole traceback
    belongs in the rank's log."""
    inner, ranks = _unwrapped(exc)
    text = "".join(traceback.format_exception_only(type(inner), inner)).strip()
    line = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return f"{line} (checkpoint ranks {ranks})" if ranks else line


def _unwrapped(exc: BaseException, depth: int = 0) -> tuple[BaseException, list[int]]:
    """(the exception a wrapper carries, the ranks it names); (exc, []) for any other exception."""
    failures = getattr(exc, "failures", None)  # CheckpointException: {rank: (exception, traceback summary)}
    if depth < 4 and isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        inner = first[0] if isinstance(first, tuple) and first else first
        if isinstance(inner, BaseException):
            found, _ = _unwrapped(inner, depth + 1)
            return found, sorted(failures)
    return exc, []


IMPORT_TIME_ENV = ("TRITON_", "MALLOC_", "OMP_", "MKL_", "HF_", "TRANSFORMERS_", "TORCH_", "PYTORCH_", "PYTHONHASHSEED")
"""Prefixes of variables read while modules import or at process start (glibc's MALLOC_*, OpenMP's, Hugging Face's
offline and cache settings, TORCH_LOGS, ...): a worker that needs other values than the forkserver started with
starts fresh. Not CUDA_* (no forkserver where CUDA is present; `megaopd`'s CLI sets CUDA_DEVICE_MAX_CONNECTIONS in
the process) nor TORCHINDUCTOR_* (read when inductor compiles, which sets its cache folder in the process)."""
_server_env: dict[str, str] | None = None
"""Those variables as the forkserver started with them (it is started once per process, at the first fork)."""


def _import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


def _context(full_env: dict[str, str], forward_signals: Sequence[int]):
    """The forkserver, or spawn where the module docstring says."""
    global _server_env
    import torch

    # the server's variables: those it started with, or this process's when this call starts it
    server_env = _server_env if _server_env is not None else _import_time(dict(os.environ))
    fresh = (
        os.environ.get("MEGAOPD_START_METHOD") == "spawn"
        or torch.cuda.is_available()
        or bool(forward_signals)
        or "forkserver" not in mp.get_all_start_methods()
        or _import_time(full_env) != server_env
    )
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    if _server_env is None:
        _server_env = server_env
        ctx.set_forkserver_preload(["megaopd.parallel._preload"])
    return ctx


def _worker(rank, world_size, port, fn, args, env, queue):
    os.environ.clear()  # the caller's environment at the call, not the forkserver's at its start
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    # Each worker gets one intra-op thread so that `world_size` workers do not oversubscribe the cores.
    import torch

    torch.set_num_threads(int(env.get("MEGAOPD_WORKER_THREADS", "1")))
    try:
        from megaopd.parallel.dist import destroy_distributed, init_distributed

        init_distributed()
        result = fn(rank, world_size, *args)
        # Plain pickle copies tensor data; the queue's own pickler would send shared-memory handles
        # that die with this process before the parent reads them.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((rank, "error", (traceback.format_exc(), one_line(e))))
        return
    try:
        destroy_distributed()
    except Exception:  # noqa: BLE001 - teardown after a successful run must not mask the result
        pass
    if mp.get_start_method(allow_none=True) == "spawn":  # a forked worker ends with os._exit already
        _leave_without_teardown()


def _leave_without_teardown() -> None:
    """Ends a spawned worker that finished its work: its threads joined and its exit handlers run (the
    engines' and helpers' shutdowns, multiprocessing's children, temporary folders), then os._exit. The
    interpreter's own teardown, which frees every object of torch, megatron-core and transformers one by one,
    is skipped: ~2.5 s of a 2-core CPU per worker while the caller waits to join it. A forked worker leaves
    the same way (multiprocessing ends it with os._exit), without even the exit handlers."""
    import atexit
    import ctypes
    import sys
    import threading

    threading._shutdown()  # what the interpreter runs first at exit: joins the threads that are not daemons
    atexit._run_exitfuncs()  # then the exit handlers
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()
    ctypes.CDLL(None).fflush(None)  # C and C++ libraries' own buffered output (exit() would flush it)
    os._exit(0)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 600,
    env: dict[str, str] | None = None,
    forward_signals: Sequence[int] = (),
) -> list[Any]:
    """Runs fn(rank, world_size, *args) in `world_size` new processes; returns results by rank.

    fn must be importable (module level): workers are forked from the forkserver or spawned (module docstring),
    and either way find it by name.
    Results must be picklable (tensors are copied back); keep them small. Signals in forward_signals
    (e.g. SIGTERM from Slurm) are passed on to every worker instead of stopping this process.
    """
    full_env = {**os.environ, **(env or {})}
    ctx = _context(full_env, forward_signals)
    queue = ctx.SimpleQueue()
    port = find_free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, tuple(args), full_env, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    import signal

    previous, forwarded = {}, set()

    def forward(signum, frame):
        forwarded.add(signum)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signum)

    for sig in forward_signals:
        previous[sig] = signal.signal(sig, forward)
    results: dict[int, Any] = {}
    errors: list[str] = []
    failed: tuple[int, str, str] | None = None  # the first rank that raised: (rank, summary, traceback)
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if time.monotonic() > deadline:
            errors.append(f"timed out after {timeout:.0f}s waiting for workers")
            break
        if not queue.empty():
            rank, status, payload = queue.get()
            if status == "ok":
                results[rank] = pickle.loads(payload)  # our own worker's bytes, not an untrusted file
            else:
                details, summary = payload
                errors.append(f"rank {rank}:\n{details}")
                failed = (rank, summary, details)
                break  # peers may now block in a collective; stop them below
        elif any(p.exitcode not in (None, 0) for p in procs):
            if queue.empty():
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                errors.append(f"worker(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}")
                break
        else:
            time.sleep(0.02)
    for sig, handler in previous.items():
        # After a forwarded signal the run is ending because of it: a copy arriving later (Slurm signals every
        # process of the step) must not kill this process with the default action while it exits.
        signal.signal(sig, signal.SIG_IGN if forwarded else handler)
    for p in procs:
        p.join(timeout=30 if not errors else 1)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise WorkerError("\n".join(errors), *(failed or ()))
    return [results[r] for r in range(world_size)]


def under_launcher() -> bool:
    """True when torchrun/srun started this process as one rank of a job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 3600,
    forward_signals: Sequence[int] = (),
) -> list[Any]:
    """fn(rank, world_size, *args) on the job's ranks.

    Under torchrun/srun this process is one rank: it initializes torch.distributed, runs fn once and
    returns [its result] (the caller checks that the job's world size suits it). Otherwise `world_size`
    local gloo workers are spawned, except that a single rank runs in this process (no second
    interpreter to start).
    """
    from megaopd.parallel.dist import destroy_distributed, init_distributed

    if under_launcher() or world_size == 1:
        init_distributed()
        import torch.distributed as dist

        try:
            return [fn(dist.get_rank(), dist.get_world_size(), *args)]
        finally:
            destroy_distributed()
    return spawn(fn, world_size, args, timeout=timeout, forward_signals=forward_signals)
