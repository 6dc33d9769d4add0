import os
import sys

# Spawned workers import test modules by name (tests.x._workers): the repo root must be importable.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("PYTHONPATH", ROOT)


import pytest  # noqa: E402


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
