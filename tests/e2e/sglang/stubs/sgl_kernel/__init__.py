"""Import-only stand-in for sgl_kernel (see ../_standin.py); every kernel raises NotImplementedError."""

import sys as _sys


from _megaopd_standin import make_standin as _make  # noqa: E402

_make(_sys.modules[__name__])
__version__ = "0.0.0+standin"
