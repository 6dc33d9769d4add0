"""megatron-core's import without the ~4 s it spends on code we never run at import (megaopd/__init__.py
installs this once per process, before anything can import megatron).

`import megatron.core` decorates its fusions (bias-GeLU, SwiGLU, GeGLU, ...) with `torch.compile` at
import, and `torch.compile(fn)` builds its inductor wrapper eagerly: ~3 s of importing inductor in every
process that imports megatron-core, on a machine where those functions are never compiled or called. Its
inference contexts import wandb for logging we never use: ~1 s more. On a 2-core CPU that is 14 -> 10 s
for a worker's start-up (every rank of `megaopd train`, every converter and test worker).

So while `megatron.core`'s package runs its imports:
- `torch.compile(fn, ...)` returns a function that compiles on its first call (what torch.compile does
  anyway: compilation happens at the first call; only the wrapper's construction moves), and megatron's
  `jit_fuser` keeps that lazy form for the modules imported later;
- an absent wandb reads as not installed to megatron (its `try: import wandb` sets None), unless the
  process already imported it. Our own wandb logger (megaopd.eval) imports it normally afterwards.
Nothing else changes; the finder removes itself after the one import.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types


def _lazy_compile(real):
    def compile(model=None, **kwargs):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile(fn, **kwargs)
        if not isinstance(model, types.FunctionType):  # modules, other callables: torch's own wrapper, now
            return real(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **kwargs)
            return compiled(*args, **kw)

        return call

    return compile


class _Loader(importlib.abc.Loader):
    """megatron.core's own loader, run with torch.compile lazy and wandb hidden."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):  # resource readers, get_filename, ...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        import torch

        real, hide_wandb = torch.compile, "wandb" not in sys.modules
        torch.compile = _lazy_compile(real)
        if hide_wandb:
            sys.modules["wandb"] = None  # `import wandb` raises ImportError
        try:
            self._loader.exec_module(module)
        finally:
            torch.compile = real
            if hide_wandb and sys.modules.get("wandb", 0) is None:
                del sys.modules["wandb"]


class MegatronCoreFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "megatron.core":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if "megatron.core" not in sys.modules and not any(isinstance(f, MegatronCoreFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MegatronCoreFinder())
