"""Import-only stand-in for torchvision (see ../_standin.py); every function raises NotImplementedError.
No package metadata is installed, so transformers' is_torchvision_available() stays False."""

import sys as _sys


from _megaopd_standin import make_standin as _make  # noqa: E402

_make(_sys.modules[__name__])
__version__ = "0.0.0+standin"
