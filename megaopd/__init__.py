"""megaopd: on-policy distillation of LLMs with Megatron-core models and SGLang rollouts.

The packages stand on floors, each importing only its own floor's package or lower floors: the table and why
are in docs/architecture.md, and tests/test_layering.py applies that table to every module.
"""

import warnings as _warnings

__version__ = "0.1.0"

# megatron-core announces at import, once per module and per process (so ~20 times in a 2-worker run), that
# it falls back to torch's norm and optimizers without Apex or Transformer Engine. That is the intended
# CPU path and an informed choice on GPUs (README, "GPU clusters: optional pieces"), so the lines say
# nothing to a user and drown the step lines; megaopd's own start-up says which layers it builds.
_warnings.filterwarnings(
    "ignore",
    message=r"(Transformer Engine and Apex are|Apex is) not installed",
    category=UserWarning,
    module=r"megatron\.",
)

# Reading a checkpoint (a resume, `megaopd logprobs`) goes through megatron's torch_dist strategy, which calls
# torch APIs torch has deprecated: FutureWarnings once per rank about code that is neither megaopd's nor the
# user's to change (megatron-core pins its torch calls). Only these two messages, only from their sources.
_warnings.filterwarnings(
    "ignore",
    message=r"`load_state_dict` is deprecated and will be removed",
    category=FutureWarning,
    module=r"megatron\.core\.dist_checkpointing\.",
)
_warnings.filterwarnings(
    "ignore",
    message=r"Please use DTensor instead and we are deprecating ShardedTensor",
    category=FutureWarning,
)

from megaopd import _megatron_import  # noqa: E402 - must run before anything imports megatron

_megatron_import.install()
