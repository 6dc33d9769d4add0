"""What the local workers' forkserver imports once for every worker it forks (megaopd.parallel.launch).

The libraries a worker of the tests and tools uses, not only their top packages: transformers and megatron-core
import most of their modules lazily, and a forked worker that imported the models, tokenizers, checkpointing,
optimizer and answer checker itself spent ~3 s of a 2-core CPU doing so (~0.4 s remain: megaopd's own modules,
which stay out of this floor-0 module).

multiprocessing's forkserver skips a preload module that raises ImportError but dies on any other exception,
and every later start with it; so each import here is guarded: a module that fails to import is left to the
worker, which imports it itself (and raises there, with its traceback, if it must).
"""

import importlib

for _name in (
    "megaopd.parallel.dist",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
    "transformers",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.llama.modeling_llama",
    "safetensors.torch",
    "math_verify",
):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - see the module docstring
        pass
