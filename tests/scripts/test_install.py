"""scripts/install.sh: its options are checked before anything is installed, and an environment that
already holds this checkout's megaopd is left alone (a second `make test` costs about a second).
Fresh installs are exercised by CI's clean clone (.ci/run: `make demo` first)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "install.sh")


def _run(**env):
    return subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=600, env={**os.environ, **env})


def test_unknown_torch_build_is_refused_before_installing():
    r = _run(MEGAOPD_TORCH="rocm", PYTHON=sys.executable)
    assert r.returncode != 0
    assert "MEGAOPD_TORCH=rocm: use cpu or cuda" in r.stderr


def test_an_installed_checkout_is_not_reinstalled():
    import pytest

    stamp = [f for f in os.listdir(sys.prefix) if f.startswith(".megaopd-install-")]
    if not stamp:
        pytest.skip("this environment was not set up by scripts/install.sh (make test does that first)")
    again = _run(PYTHON=sys.executable)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "up to date" in again.stdout and "installing" not in again.stdout
