"""A worker's exception reaches the caller as a WorkerError that names the rank and carries the exception in
one line (what `megaopd train` prints) and the traceback apart (what it writes to RUN/logs), so the terminal
shows the message, not a 30-110 line double traceback with the message on its last line."""

import pytest
import torch

from megaopd.parallel.launch import WorkerError, one_line, spawn
from tests.parallel import _workers

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="workers are spawned fresh where CUDA is present")


def test_worker_error_has_the_rank_one_line_and_the_traceback():
    with pytest.raises(WorkerError) as e:
        spawn(_workers.raise_in_rank_one, 2)
    assert e.value.rank == 1
    assert e.value.summary == "ValueError: rank one fails on purpose"
    assert e.value.details.startswith("Traceback") and "raise_in_rank_one" in e.value.details


def test_one_line_joins_a_messages_lines():
    assert one_line(ValueError("first\n  second")) == "ValueError: first second"
