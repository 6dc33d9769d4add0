# The engine tests' tiny models and engine (tests/engine/conftest.py), and one torch thread per test.
from tests.engine.conftest import _one_torch_thread, engine, eos_dir, pytest_configure, tiny_dir  # noqa: F401
