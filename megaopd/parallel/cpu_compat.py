"""Lets megatron-core run on a machine without a GPU (gloo, float32). Used only when CUDA is absent.

megatron-core 0.16 assumes CUDA in four places that a CPU forward/backward reaches:
  1. `torch.cuda.current_device()` / `torch.cuda.synchronize()` (global memory buffer, p2p schedule);
  2. the CUDA RNG tracker, whose `fork()` reads and writes CUDA RNG state around TP-region init/dropout;
  3. factory calls with `device="cuda"` (or `torch.cuda.current_device()`), e.g. the pipeline schedule's
     `torch.zeros(..., device="cuda")`;
  4. `clip_grad_by_total_norm_fp32`, which asserts `param.grad.type() == 'torch.cuda.FloatTensor'`.
Each is patched here and nowhere else. The patches are process-global and idempotent; `enable()` is
called by `megaopd.parallel.dist.init_distributed` when no GPU is present, so library code never needs
to know which machine it runs on.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys

import torch
from torch.overrides import TorchFunctionMode

_enabled = False
_device_mode: "_CudaToCpuMode | None" = None

# Factory functions whose `device=` keyword megatron passes as "cuda" or an int.
_FACTORIES = {
    torch.empty,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.tensor,
    torch.empty_like,
    torch.zeros_like,
    torch.ones_like,
    torch.full_like,
    torch.randn_like,
    torch.rand_like,
    torch.as_tensor,
    torch.linspace,
    torch.eye,
    torch.empty_strided,
}

_REWRITTEN = frozenset(_FACTORIES | {torch.Tensor.cuda, torch.Tensor.to})


def _to_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites `device=cuda` in tensor factories and `.cuda()` / `.to("cuda")` calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of the process passes through here: return at once for all but the few rewritten.
        if func not in _REWRITTEN:
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        elif func is torch.Tensor.cuda:
            return args[0]
        elif func is torch.Tensor.to:
            if "device" in kwargs:
                kwargs["device"] = _to_cpu_device(kwargs["device"])
            args = tuple(_to_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


class _CpuRNGTracker:
    """Stands in for megatron's CudaRNGStatesTracker: named states are CPU generator states.

    fork(name) swaps the default CPU generator to the named state for the block, so TP-region init
    and dropout draw from per-TP-rank streams exactly as on GPU.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def is_initialized(self):
        return bool(self.states_)

    def get_states(self):
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states):
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name, seed):
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            # megatron forks before any seed was added when the model is built without
            # model_parallel_cuda_manual_seed; CPU init then simply uses the default generator.
            yield
            return
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Device-agnostic copy of megatron's clip: scales .grad (or .decoupled_grad) in place."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for p in parameters:
            g = getattr(p, attr, None)
            if g is not None:
                g.detach().mul_(clip_coeff)


def _patch_rng_tracker(mrandom) -> None:
    mrandom.CudaRNGStatesTracker = _CpuRNGTracker
    mrandom.initialize_rng_tracker(force_reset=True)


def _patch_clip_grads(clip_grads) -> None:
    # megatron.core.optimizer.optimizer imports the function by name right after this module runs,
    # so patching here also patches its copy.
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    if "megatron.core.optimizer.optimizer" in sys.modules:  # imported before enable()
        sys.modules["megatron.core.optimizer.optimizer"].clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32


_MEGATRON_PATCHES = {
    "megatron.core.tensor_parallel.random": _patch_rng_tracker,
    "megatron.core.optimizer.clip_grads": _patch_clip_grads,
}


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Applies the megatron patches when megatron's modules are first imported, so that processes
    that never use megatron (most spawned test workers) do not pay its multi-second import."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _MEGATRON_PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        self._loaders = getattr(self, "_loaders", {})
        self._loaders[fullname] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module):
        self._loaders[module.__name__].exec_module(module)
        _MEGATRON_PATCHES[module.__name__](module)


def enable() -> None:
    """Installs the CPU patches (idempotent). Called before any megatron model is built."""
    global _enabled, _device_mode
    if _enabled:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat.enable() called on a machine with a GPU; use the CUDA path")

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda *a, **k: None  # type: ignore[assignment]

    pending = []
    for name, patch in _MEGATRON_PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            pending.append(name)
    if pending:
        sys.meta_path.insert(0, _PatchOnImport())

    _device_mode = _CudaToCpuMode()
    _device_mode.__enter__()  # stays active for the life of the process
    _enabled = True
