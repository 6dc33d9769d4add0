"""`megaopd serve` serving SmolLM2-135M-Instruct over SGLang's HTTP API: greedy generation of real chat prompts
equals transformers' greedy, and prefill scores (input log-probs and top-K, what a served teacher answers)
equal transformers' float64 forward."""

from __future__ import annotations

import pytest

from megaopd.parallel.dist import find_free_port
from megaopd.serving.sglang_launcher import ServerProcess, megaopd_serve_command
from tests.real import reference

pytestmark = [pytest.mark.slow, pytest.mark.real]


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory):
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    log = str(tmp_path_factory.mktemp("serve_logs") / f"megaopd-serve-{port}.log")
    process = ServerProcess.start(
        megaopd_serve_command(smollm2, port, extra_args=["--num-threads", "1"]),
        url=url,
        startup_timeout_s=600,
        log_path=log,
        env={"PYTHONPATH": reference.ROOT},
        die_with_parent=True,
    )
    yield url
    process.stop()


def test_megaopd_serve_generation_and_prefill(served, chat_prompts, hf_greedy, hf64, tokenizer):
    reference.check_served_model(served, "megaopd serve", chat_prompts, hf_greedy, hf64, tokenizer)
