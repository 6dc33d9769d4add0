"""Convert a megaopd Megatron checkpoint back into an HF directory that transformers loads.

    python tools/convert_megatron_to_hf.py --ckpt CKPT_DIR --out HF_DIR [--tp 1 --pp 1]
    python tools/convert_megatron_to_hf.py --ckpt LORA_CKPT --out ADAPTER_DIR --lora-export adapter

Writes model.safetensors (sharded with an index past 4 GiB) in the checkpoint's dtype, with megatron's
vocabulary padding trimmed and tied embeddings stored once, plus config.json and the tokenizer files
copied from the checkpoint. HF -> Megatron -> HF is bit-exact. The checkpoint is loaded at --tp/--pp
(default one process, whatever layout it was written at). A LoRA student's checkpoint is written merged
(W + (alpha / r) B A in float32 math, cast to the checkpoint's dtype) or, with --lora-export adapter, as a peft
adapter folder (adapter_config.json, adapter_model.safetensors in HF module names) that
peft.PeftModel.from_pretrained loads onto the HF base. Bad inputs exit 2 with one line.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaopd.models.cli_util import OneLineArgumentParser, report, run_cli  # noqa: E402

PROG = "convert_megatron_to_hf"


def main(argv=None) -> int:
    ap = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="megaopd Megatron checkpoint directory")
    ap.add_argument("--out", required=True, help="new (or empty) HF output directory")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size to load at")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to load at")
    ap.add_argument(
        "--lora-export",
        default="merged",
        choices=("merged", "adapter"),
        help="a LoRA checkpoint: the merged HF model (default) or the peft adapter folder",
    )
    a = ap.parse_args(argv)

    def body():
        from megaopd.models.convert import megatron_to_hf

        megatron_to_hf(a.ckpt, a.out, a.tp, a.pp, a.lora_export)
        report(f"{PROG}: wrote {a.out}")

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
