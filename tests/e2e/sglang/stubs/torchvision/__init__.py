"""Import-only stand-in for torchvision (the PyPI wheel is a CUDA build; SGLang uses it for vision models
only): every name imports, every call raises NotImplementedError (../_megaopd_standin.py). No package
metadata is installed beside it, so transformers' is_torchvision_available() stays False."""
import sys as _sys

from _megaopd_standin import make_standin as _make

_make(_sys.modules[__name__])
__version__ = "0.0.0+standin"
