"""A resume and `megaopd logprobs` print no third-party FutureWarnings (issue 54: 4 and 6 lines before): megaopd
silences exactly the two messages megatron's torch_dist checkpoint reader triggers, from their sources, and
nothing else (another FutureWarning, or the same text from another module, still shows)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = r"""
import warnings
import megaopd  # installs the filters
def warn(message, module):
    warnings.warn_explicit(message, FutureWarning, filename=module.replace(".", "/") + ".py", lineno=1, module=module)
warn("`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead.",
     "megatron.core.dist_checkpointing.strategies.torch")
warn("Please use DTensor instead and we are deprecating ShardedTensor.", "megaopd.parallel.cpu_compat")
warn("`load_state_dict` is deprecated and will be removed in future versions.", "somebody.else")
warn("another deprecation", "megatron.core.dist_checkpointing.strategies.torch")
"""


def test_checkpoint_reader_warnings_are_silenced_and_only_they():
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": ""}
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    shown = [line for line in r.stderr.splitlines() if "FutureWarning" in line]
    assert len(shown) == 2, r.stderr
    assert "somebody/else.py" in shown[0] and "another deprecation" in shown[1]
