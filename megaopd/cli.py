"""`megaopd <command> ...`: one entry point; each command lives in the package that owns it.

megaopd train CONFIG [key=value ...]   the OPD trainer (megaopd.trainer)
megaopd eval --ckpt DIR --benchmarks ...  benchmark table (megaopd.eval)
megaopd logprobs --ckpt DIR --input IN.jsonl --output OUT.jsonl   per-token log-probs (megaopd.scoring)
megaopd serve --hf-dir DIR --port P    embedded engine speaking SGLang's HTTP API (megaopd.serving)
megaopd plot RUN [RUN ...]             training-dynamics figures (megaopd.metrics)
megaopd config CONFIG [key=value ...]  the fully resolved config as YAML: what the job runs (megaopd.config);
                                       files not there yet are one warning line (--strict: refused, as train does)
megaopd plan CONFIG [key=value ...]    per-GPU memory of the configured layout; exit 1 when it does not fit
megaopd plan --step-time CONFIG ...    + the step time of each rollout.mode on 1-8 nodes (estimates)
"""

from __future__ import annotations

import importlib
import os
import sys

# command -> "module:function"; modules are imported only when their command runs (megatron's import
# costs seconds, `megaopd --help` should not).
COMMANDS = {
    "train": "megaopd.trainer.cli:main",
    "eval": "megaopd.eval.cli:main",
    "logprobs": "megaopd.scoring.cli:main",
    "serve": "megaopd.serving.cli:main",
    "plot": "megaopd.metrics.plot:main",
    "config": "megaopd.config.cli:config_main",
    "plan": "megaopd.config.cli:plan_main",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"megaopd: unknown command {command!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    # megatron's tensor-parallel layers rely on one CUDA work queue to order their asynchronous gradient
    # all-reduce before the weight-gradient GEMM (and warn without it); set before any CUDA context, as
    # slurm/common.sh does, so that local runs get it too. Spawned workers inherit it.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    module_name, func_name = COMMANDS[command].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
