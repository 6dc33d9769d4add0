"""`megaopd logprobs`: per-token log-probs of token sequences under a Megatron model at any TP/PP.

    megaopd logprobs --ckpt DIR --tp 2 --pp 1 --input IN.jsonl --output OUT.jsonl [--micro-batch-size 4]

IN.jsonl: one {"input_ids": [...]} per line. OUT.jsonl: one {"logprobs": [...]} per input line, in
order: log p(x_{i+1} | x_0..x_i) for i = 0..len-2 (len - 1 values, float32 math). --ckpt is a megaopd
Megatron checkpoint (tools/convert_hf_to_megatron.py) or an HF directory, converted on the fly. On CPU
it starts tp*pp gloo workers; under torchrun it uses the job's ranks. Log-probs come from vocab-sharded
logits with TP all-reduces (megaopd.scoring, the trainer's own pass); no rank holds full-vocabulary logits.
Inputs are checked first; a bad input exits 2 with one line naming it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from megaopd.models.cli_util import OneLineArgumentParser, report, run_cli
from megaopd.models.hf_config import HFModelConfig, InputError, check_layout, read_hf_config

PROG = "megaopd logprobs"


def read_sequences(path: str, vocab_size: int) -> list[list[int]]:
    """The input_ids of each line; InputError naming the line for anything malformed."""
    if not os.path.isfile(path):
        raise InputError(f"input file {path} does not exist")
    seqs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            ids = row.get("input_ids") if isinstance(row, dict) else None
            if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
                raise InputError(f'{path}:{lineno}: expected {{"input_ids": [int, ...]}} with at least one id')
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise InputError(f"{path}:{lineno}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
            seqs.append(ids)
    if not seqs:
        raise InputError(f"input file {path} holds no sequences")
    return seqs


def resolve_model(ckpt: str) -> tuple[HFModelConfig, bool]:
    """(config, whether it is a megaopd Megatron checkpoint, not an HF directory) of --ckpt, validated from its
    small files."""
    from megaopd.models.checkpoint import is_megatron_checkpoint, read_checkpoint_meta

    if not os.path.isdir(ckpt):
        raise InputError(f"--ckpt {ckpt} does not exist")
    if is_megatron_checkpoint(ckpt):
        read_checkpoint_meta(ckpt)
        return read_hf_config(ckpt), True
    if os.path.isfile(os.path.join(ckpt, "config.json")):
        from megaopd.models.convert import validate_hf_dir

        return validate_hf_dir(ckpt)[0], False
    raise InputError(f"--ckpt {ckpt} is neither a megaopd Megatron checkpoint nor an HF directory (no config.json)")


@dataclass(frozen=True, kw_only=True)
class _ScoreJob:
    """What every rank of `megaopd logprobs` scores, and where rank 0 writes it."""

    ckpt: str
    megatron: bool
    """A megaopd Megatron checkpoint; False: an HF directory (resolve_model)."""
    tp: int
    pp: int
    seqs: list[list[int]]
    output: str
    micro_batch_size: int


def _worker(rank: int, world: int, job: _ScoreJob):
    import torch.distributed as dist

    from megaopd.models.builder import BuildOptions, StageInfo, build_gpt_model
    from megaopd.models.checkpoint import load_model_checkpoint
    from megaopd.models.hf_io import HFWeights
    from megaopd.models.weights import Placement, load_hf_weights
    from megaopd.ops.head import DEFAULT_CHUNK_TOKENS
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.scoring.passes import score_sequences
    from megaopd.scoring.runner import PipelineRunner

    ckpt, tp, pp, output = job.ckpt, job.tp, job.pp, job.output
    pgs = initialize_actor_layout(Layout(tp, pp))
    cfg = read_hf_config(ckpt)
    # float32 scoring: log-probs are compared with other engines token by token.
    model = build_gpt_model(cfg, Layout(tp=tp, pp=pp), pgs, BuildOptions(dtype="float32", init_weights=False))
    st = StageInfo.of(pgs)
    if job.megatron:
        load_model_checkpoint(model, ckpt, pgs)
    else:
        load_hf_weights(
            model, HFWeights(ckpt), cfg, Placement(tp_rank=st.tp_rank, tp_size=tp, pp_rank=st.pp_rank, pp_size=pp)
        )
    model.eval()
    # The fused output layer: logits DEFAULT_CHUNK_TOKENS tokens at a time, never the micro-batch's.
    runner = PipelineRunner(model, pgs, cfg.vocab_size, logits_chunk_tokens=DEFAULT_CHUNK_TOKENS)
    result = score_sequences(runner, job.seqs, micro_batch_size=job.micro_batch_size)
    if dist.get_rank() == 0:
        tmp = output + ".tmp"
        with open(tmp, "w") as f:
            for lp in result:
                f.write(json.dumps({"logprobs": lp}) + "\n")
        os.replace(tmp, output)
    return rank


def main(argv=None) -> int:
    ap = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="megaopd Megatron checkpoint or HF directory")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--input", required=True, help='JSONL, one {"input_ids": [...]} per line')
    ap.add_argument("--output", required=True, help='JSONL, one {"logprobs": [...]} per input line')
    ap.add_argument("--micro-batch-size", type=int, default=4)
    a = ap.parse_args(argv)

    def body():
        from megaopd.models.ranks import check_world
        from megaopd.parallel.launch import run_on_ranks

        cfg, megatron = resolve_model(a.ckpt)
        check_layout(cfg, a.tp, a.pp)
        if a.micro_batch_size < 1:
            raise InputError(f"--micro-batch-size must be >= 1 (got {a.micro_batch_size})")
        seqs = read_sequences(a.input, cfg.vocab_size)
        out_parent = os.path.dirname(os.path.abspath(a.output))
        if not os.path.isdir(out_parent):
            raise InputError(f"output directory {out_parent} does not exist")
        check_world(a.tp * a.pp)
        job = _ScoreJob(
            ckpt=a.ckpt,
            megatron=megatron,
            tp=a.tp,
            pp=a.pp,
            seqs=seqs,
            output=a.output,
            micro_batch_size=a.micro_batch_size,
        )
        run_on_ranks(_worker, a.tp * a.pp, (job,))
        report(f"{PROG}: wrote {len(seqs)} lines to {a.output}")

    return run_cli(PROG, body)
