"""megaopd._megatron_import: megatron-core imported without building inductor wrappers or importing wandb,
and with nothing else changed."""

import subprocess
import sys

import torch

from megaopd._megatron_import import _lazy_compile


def test_a_fresh_process_imports_megatron_without_inductor_or_wandb_and_restores_both():
    code = """
import sys, torch, megaopd
real = torch.compile
import megatron.core
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
assert 'torch._inductor.compile_fx' not in sys.modules, 'inductor was imported'
assert 'wandb' not in sys.modules, sys.modules.get('wandb')
assert torch.compile is real, 'torch.compile was not restored'
assert jit.jit_fuser is not real and fused_bias_swiglu.swiglu.__name__ == 'swiglu'
assert not [f for f in sys.meta_path if type(f).__name__ == 'MegatronCoreFinder'], 'the finder stayed'
import wandb  # our own logger can still import it
print('ok')
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_lazy_compile_compiles_once_at_the_first_call_with_the_same_arguments():
    calls = []

    def real(model, **kwargs):
        calls.append(kwargs)
        return torch.compile(model, **kwargs)

    compile = _lazy_compile(real)

    def f(x):
        return torch.sin(x) * 2

    g = compile(f, backend="eager")
    h = compile(backend="eager", dynamic=False)(f)  # the decorator-factory form
    assert calls == [] and g.__name__ == "f"
    x = torch.randn(5)
    for _ in range(2):
        assert torch.equal(g(x), f(x)) and torch.equal(h(x), f(x))
    assert calls == [{"backend": "eager"}, {"backend": "eager", "dynamic": False}]
    module = torch.nn.Linear(2, 2)
    assert compile(module, backend="eager") is not module and len(calls) == 3  # modules: compiled wrapper now
