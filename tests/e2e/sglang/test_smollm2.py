"""SGLang 0.5.23's own server serving the real SmolLM2-135M-Instruct (scripts/install_smollm2.sh): greedy generation
of real chat prompts equals transformers' greedy, and prefill scores equal transformers' float64 forward, the
same checks `megaopd serve` passes in tests/real/test_serve.py.

Here rather than in tests/real: it needs this group's SGLang venv (the sglang_python fixture), and the xdist
group "sglang" runs SGLang servers one after another. `make test-real` runs it with tests/real.
"""

from __future__ import annotations

import pytest

from tests.e2e.sglang.conftest import _start_sglang
from tests.real import reference

pytestmark = [pytest.mark.slow, pytest.mark.real, pytest.mark.sglang]


@pytest.fixture(scope="module")
def smollm2() -> str:
    return reference.install()


@pytest.fixture(scope="module")
def sglang_smollm2(sglang_python, smollm2, tmp_path_factory):
    served = _start_sglang(sglang_python, smollm2, tmp_path_factory.mktemp("sglang_logs"))
    yield served
    served.process.stop()


def test_sglang_serves_smollm2(sglang_smollm2, smollm2):
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)  # the server has one thread; this process's reference forward takes the other core
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    hf64 = reference.load_hf(smollm2)
    prompts = [reference.chat_ids(tokenizer, text) for text in reference.CHATS]
    greedy = [reference.hf_greedy(hf64, p, [tokenizer.eos_token_id]) for p in prompts]
    try:
        reference.check_served_model(sglang_smollm2.url, "SGLang 0.5.23", prompts, greedy, hf64, tokenizer)
    except AssertionError:
        print(sglang_smollm2.log_tail())
        raise
