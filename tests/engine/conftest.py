import pytest

from tests.engine._models import build_tiny_qwen2


def pytest_configure(config):
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every test here runs on one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A random tiny Qwen2 (hidden 64, vocab 128, EOS 2) saved in HF format."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), seed=0)


@pytest.fixture(scope="session")
def eos_dir(tmp_path_factory):
    """A tiny Qwen2 whose lm_head makes EOS likely (responses of 1-30 tokens at T=1)."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_eos"), seed=1, eos_boost=0.5)


@pytest.fixture(scope="session")
def engine(tiny_dir):
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir, max_batch_size=16))
