"""megaopd: on-policy distillation of LLMs with Megatron-core models and SGLang rollouts.

The packages stand on floors (docs/architecture.md; tests/test_layering.py checks them): each imports its
own floor's package or lower floors only, and the libraries never import an application.

    0  parallel, ops           distributed start-up and groups; vocab-parallel math
    1  models, data, metrics,  HF <-> Megatron models; prompts and golden solutions; rollout metrics;
       losses                  every objective as a pure function of a LossInputs record
    3  rollout                 engines generate responses -> RolloutBatch / TokenScores records
    4  batching                rows -> micro-batches: DP shares, row owners, padding, packing, field table
    5  scoring, sync           the pipeline runner and scoring passes; weight sync to the engines
    6  eval                    benchmark evaluation
    7  trainer                 the step loop composing them: optimizer, checkpoints, run log
    8  config                  the job's schema, composed from each package's own section
    9  gpucheck                the GPU bring-up check
`megaopd <command>`: cli.py (entry points, */cli.py, may import any floor).
"""

import warnings as _warnings

__version__ = "0.1.0"

# megatron-core announces at import, once per module and per process (so ~20 times in a 2-worker run), that
# it falls back to torch's norm and optimizers without Apex or Transformer Engine. That is the intended
# CPU path and an informed choice on GPUs (README, "GPU clusters: optional pieces"), so the lines say
# nothing to a user and drown the step lines; megaopd's own start-up says which layers it builds.
_warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed",
                         category=UserWarning, module=r"megatron\.")

from megaopd import _megatron_import  # noqa: E402 - must run before anything imports megatron

_megatron_import.install()
