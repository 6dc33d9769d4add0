import os
import sys

# Spawned workers import test modules by name (tests.x._workers): the repo root must be importable.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("PYTHONPATH", ROOT)

# Under pytest-xdist (make test and make test-e2e run two workers) each worker gets its share of the cores for torch's
# intra-op threads, here and in every process it starts (trainer ranks, servers). Two workers each running two
# OpenMP threads on two cores spin in each other's barriers: the tier then took as long as one worker.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    # The cores this process may run on (a container's or taskset's share), not the machine's.
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, _CORES // _WORKERS))


import pytest  # noqa: E402

# Tests that share something beyond their file run in one worker, one after another: the SGLang venv install
# and its servers (session fixtures), the local Slurm cluster, the real model (tests/real: its session fixtures
# and float64 reference, and one 135M-parameter job at a time so the tier's peak memory stays that of one).
_SHARED = {"tests/e2e/sglang/": "sglang", "tests/slurm/": "slurm", "tests/real/": "real"}
# The groups that take longest (minutes each on a 2-core CPU) start first, so no worker is left with one at
# the end (with --no-loadscope-reorder, workers take groups in the order of the items).
_LONGEST_FIRST = [
    "sglang",
    "real",
    "slurm",
    "tests/models/test_tools.py",
    "tests/trainer/test_end_to_end.py",
    "tests/examples/test_tiny_models.py",
]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks into the test ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (--dist loadgroup) a file's tests run in one worker, so its module fixtures (a
    served engine, a trained run) are made once."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in items:
        path = item.nodeid.split("::")[0]
        group = next((g for prefix, g in _SHARED.items() if path.startswith(prefix)), path)
        item.add_marker(pytest.mark.xdist_group(group))
    rank = {g: i for i, g in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.get_closest_marker("xdist_group").args[0], len(rank)))


@pytest.fixture
def one_torch_thread():
    """One intra-op thread while a test runs: on a shared 2-core machine more threads spin against other
    jobs and a tiny forward runs ~10x slower. Restored afterwards (the setting is process-wide). The
    rollout, eval and served-teacher tests use it for every test."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_gloo_rank():
    """A one-rank gloo process group for a module whose code calls torch.distributed (rank-0 work, reductions
    over the world) without spawning workers; none made when a group already exists."""
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    path = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    if os.path.exists(path):
        os.remove(path)
