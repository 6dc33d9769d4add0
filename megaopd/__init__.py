"""megaopd: on-policy distillation of LLMs with Megatron-core models and SGLang rollouts.

The packages along the data's path of one training step (docs/architecture.md):

    data      prompts and golden solutions (datasets, templates, tokenization, stop tokens)
    rollout   engines generate responses -> RolloutBatch (the one record from engine to loss)
    scoring   the pipeline runner and the scoring passes: actor log pi_old, teacher log q, parity probe
    losses    every objective as a pure function of a LossInputs record, one registry with LossNeeds
    sync      weight sync: actor shards -> HF tensors -> engines (in-process, NCCL/gloo group, CUDA IPC)
    trainer   the step loop composing them: micro-batches, optimizer, checkpoints, run log

No package imports from one later in that order (tests/test_layering.py); the trainer composes them all.
Libraries any of them may use: config, parallel, models (HF <-> Megatron), ops (vocab-parallel math),
metrics, eval. `megaopd <command>`: cli.py.
"""

import warnings as _warnings

__version__ = "0.1.0"

# megatron-core announces at import, once per module and per process (so ~20 times in a 2-worker run), that
# it falls back to torch's norm and optimizers without Apex or Transformer Engine. That is the intended
# CPU path and an informed choice on GPUs (README, "GPU clusters: optional pieces"), so the lines say
# nothing to a user and drown the step lines; megaopd's own start-up says which layers it builds.
_warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed",
                         category=UserWarning, module=r"megatron\.")
