"""Weight sync from a Megatron actor at TP=2 or PP=2 into a `megaopd serve` process over loopback: after
the sync the engine's log-probs equal the actor's (float32, < 1e-4) and differ from the pre-sync ones.
The in-process embedded engine path is covered by every trainer run's parity check (tests/trainer)."""

import pytest

from megaopd.parallel.dist import find_free_port
from megaopd.parallel.launch import spawn
from megaopd.serving.sglang_launcher import ServerProcess, megaopd_serve_command
from tests.sync import _workers
from tests.trainer.tiny_models import make_tiny_pair


@pytest.mark.slow
def test_megatron_actor_syncs_into_server(tmp_path):
    student, _ = make_tiny_pair(str(tmp_path / "models"))
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    with ServerProcess.start(
        megaopd_serve_command(student, port, extra_args=["--num-threads", "1"]), url=url, startup_timeout_s=300
    ):
        for seed, (tp, pp) in enumerate([(2, 1), (1, 2)], start=1):
            before, after = spawn(_workers.actor_to_server, 2, args=(student, url, tp, pp, seed), timeout=600)[0]
            assert after < 1e-4, (tp, pp, after)
            assert before > 1e-2, (tp, pp, before)  # the engine really served other weights before the sync
