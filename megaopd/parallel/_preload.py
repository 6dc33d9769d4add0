"""What the local workers' forkserver imports once for every worker it forks (megaopd.parallel.launch).

multiprocessing's forkserver skips a preload module that raises ImportError but dies on any other exception,
and every later start with it; so each import here is guarded: a module that fails to import is left to the
worker, which imports it itself (and raises there, with its traceback, if it must).
"""
import importlib

for _name in ("megaopd.parallel.dist", "torch.distributed", "megatron.core", "transformers"):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - see the module docstring
        pass
