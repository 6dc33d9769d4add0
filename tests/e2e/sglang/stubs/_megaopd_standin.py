"""Shared machinery of the import-only stand-ins in this folder (sgl_kernel, torchvision).

SGLang 0.5.23 imports sgl_kernel (its CUDA/CPU kernels; the CPU build is not on PyPI) and torchvision (the
PyPI wheel is a CUDA build) at module level in files that a Qwen2 model served on a CPU with
--attention-backend torch_native --sampling-backend pytorch never calls into. A stand-in lets those
imports succeed: every submodule exists, every name is a `Missing` that raises NotImplementedError when
called, so a code path that really needs a kernel fails loudly with the kernel's name instead of computing
something else. Nothing here computes anything.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class Missing:
    """A name of the stood-in package: attributes are further Missing names; calling one raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "Missing":
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is an import-only stand-in (tests/e2e/sglang/stubs): the real "
                                  "package is not installed; this code path needs it")

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `ROOT.anything.deeper` importable as an empty stand-in module."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        make_standin(module)


def make_standin(module: types.ModuleType) -> None:
    """Turns `module` into a stand-in: unknown attributes are Missing names; submodules import as stand-ins."""
    module.__path__ = []  # a package: submodule imports go through the finder
    module.__getattr__ = lambda attr: _module_attr(module.__name__, attr)
    root = module.__name__.split(".")[0]
    if not any(isinstance(f, _Finder) and f.root == root for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(root))


def _module_attr(name: str, attr: str):
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(attr)
    return Missing(f"{name}.{attr}")
