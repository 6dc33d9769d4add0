"""megaopd.ops' Triton path (impl="triton": megaopd/ops/_triton.py, _kernels.py) on CPU through Triton's
interpreter, against the float64 full-vocabulary references: the suite's cases (tests/ops/_cases.py: extreme
logits, temperatures, bf16, ties, padding columns) at TP=1 and TP=2 (gloo), and a larger vocabulary under
forced launch configurations (block tails, several splits per row, a split that is all padding). The checks
run in spawned workers with TRITON_INTERPRET=1 (tests/ops/_triton_checks.py says why). The interpreter runs
~0.2 M logits/s, so shapes stay small; the GPU check (part a) runs the same path at V=152064 on a GPU.

    pytest tests/ops/test_triton.py        # skipped when triton is not installed
"""

import pytest
import torch

pytest.importorskip(
    "triton", reason="megaopd.ops' Triton path needs triton (scripts/install.sh installs triton==3.7.1)"
)

from megaopd import ops  # noqa: E402
from megaopd.parallel.launch import spawn  # noqa: E402
from tests.ops import _cases, _triton_checks  # noqa: E402

# The quick tier runs what the GPU path most depends on (bf16, padding columns, several splits, logits ~1e4);
# the slow tier more cases at TP=1, and at TP=2 those where the shards' partials meet (ties across shards, a
# shard all padding at TP=2's boundary, bf16). The interpreter is slow: about a minute for both on this CPU.
QUICK_CASES = ("bf16", "padded")
SLOW_CASES = ("unit", "ragged_3d_hot", "offset_1e4", "scale_1e4_temp")
TP2_CASES = ("unit", "bf16", "padded", "ties")
QUICK_CONFIGS = ("splits_bf16_padded", "extreme")
SLOW_CONFIGS = tuple(c for c in _triton_checks.LAUNCH_CONFIGS if c not in QUICK_CONFIGS)
INTERPRET = {"TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def quick():
    """One worker for every quick check (a process start costs seconds here)."""
    (out,) = spawn(
        _triton_checks.run, world_size=1, timeout=600, env=INTERPRET, args=(QUICK_CASES, QUICK_CONFIGS, True)
    )
    return out


@pytest.mark.parametrize("name", QUICK_CASES)
def test_tp1_matches_float64_reference(quick, name):
    assert not quick[f"case {name}"], "\n".join(quick[f"case {name}"])


@pytest.mark.slow
def test_tp1_other_cases_match_float64_reference():
    (out,) = spawn(_triton_checks.run, world_size=1, timeout=600, env=INTERPRET, args=(SLOW_CASES, SLOW_CONFIGS))
    errors = sum(out.values(), [])
    assert not errors, "\n".join(errors)


@pytest.mark.slow
def test_tp2_matches_float64_reference():
    results = spawn(_triton_checks.run, world_size=2, timeout=600, env=INTERPRET, args=(TP2_CASES, ()))
    errors = []
    for case in (c for c in _cases.CASES if c.name in TP2_CASES):
        errors += _cases.compare(case, 2, [r[f"case {case.name}"][0] for r in results], _cases.reference(case, 2))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("config", QUICK_CONFIGS)
def test_launch_configs_match_float64_reference(quick, config):
    assert not quick[f"launch {config}"], "\n".join(quick[f"launch {config}"])


def test_overwrite_q_and_strided_rows(quick):
    errors = quick["overwrite_q and strided rows"]
    assert not errors, "\n".join(errors)


def test_impl_choice(monkeypatch):
    from megaopd.ops import _common

    x = torch.randn(2, 8)
    assert _common.resolve_impl("auto", x) == "torch"  # CPU: the torch path, interpreter or not
    with pytest.raises(ValueError, match="impl must be one of"):
        ops.vocab_parallel_logprobs(x, torch.zeros(2, dtype=torch.long), impl="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ops.vocab_parallel_entropy(x, impl="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _common.resolve_impl("triton", x) == "triton"
    monkeypatch.setattr(_common, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="triton==3.7.1"):
        ops.vocab_parallel_kl(x, x, impl="triton")
    assert _common.resolve_impl("auto", x) == "torch"


def test_kernels_compile_for_an_h100(monkeypatch, tmp_path):
    """The compiled (not interpreted) kernels, built for sm_90 on this CPU with triton's own ptxas."""
    from triton.runtime.interpreter import InterpretedFunction

    from megaopd.ops import _kernels

    if isinstance(_kernels.stats_kernel, InterpretedFunction):
        pytest.skip("TRITON_INTERPRET=1 in the test process: the kernels were defined interpreted")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, not from an earlier cache
    errors = _triton_checks.compile_for_gpu(90)
    assert not errors, "\n".join(errors)
