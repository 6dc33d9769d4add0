"""Import-only stand-in for sgl_kernel (SGLang's kernels; the CPU build is not on PyPI): every name imports,
every call raises NotImplementedError (../_megaopd_standin.py). The stubs folder goes on the SGLang server's
PYTHONPATH (tests/e2e/sglang/conftest.py); nothing else imports it."""
import sys as _sys

from _megaopd_standin import make_standin as _make

_make(_sys.modules[__name__])
__version__ = "0.0.0+standin"
