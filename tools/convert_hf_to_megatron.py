"""Convert an HF Qwen2/Qwen2.5/Llama/Qwen3/Qwen3-MoE directory (safetensors) into a megaopd Megatron checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir HF_DIR --out CKPT_DIR --tp 2 --pp 2 [--ep 2 (MoE)]

On a machine without torchrun it starts tp*pp*ep local gloo workers itself; under torchrun/srun it uses
the job's ranks (a multiple of tp*pp*ep). The checkpoint (megatron dist_checkpointing, torch_dist) holds
config.json and the tokenizer files too, and loads at any TP/PP (see megaopd/models/checkpoint.py).
Inputs are checked first: a bad directory, config or layout exits 2 with one line, before any start-up.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaopd.models.cli_util import OneLineArgumentParser, report, run_cli  # noqa: E402

PROG = "convert_hf_to_megatron"


def main(argv=None) -> int:
    ap = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", required=True, help="HF model directory: config.json + *.safetensors")
    ap.add_argument("--out", required=True, help="new (or empty) checkpoint directory")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size to write at")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to write at")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size to write at (MoE models)")
    a = ap.parse_args(argv)

    def body():
        from megaopd.models.convert import hf_to_megatron

        hf_to_megatron(a.hf_dir, a.out, a.tp, a.pp, a.ep)
        report(f"{PROG}: wrote {a.out} (tp={a.tp}, pp={a.pp}, ep={a.ep})")

    return run_cli(PROG, body)


if __name__ == "__main__":  # required: dist_checkpointing's writer processes re-import this module
    sys.exit(main())
