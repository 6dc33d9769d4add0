"""Peak memory of the scoring pass and of one training micro-batch (forward + Stable-OPD loss + backward) at a
large vocabulary, measured on CPU: the whole logits (the model's own output layer, trainer.logits_chunk_tokens=0)
against the fused output layer (logits --chunk-tokens at a time, megaopd.ops.head) in one run, and optionally
against an earlier revision.

    python benchmarks/memory.py [--chunk-tokens 128] [--before REV] [--vocab 32000] [--tokens 2048] [--seqs 8]
                                [--chunk-mib 4]

A bf16 random Qwen2 (hidden 64, 2 layers: the model is small on purpose, so the logits [tokens, V] dominate
as they do for a 1.5B model at 16k tokens x 152k ids) is run through megaopd's PipelineRunner in one gloo
process:
    score, packed     score_tokens(..., ScoringBatches(seqs, max_tokens=tokens), ScoreRequest(1.0, entropy=True)):
                      one packed row of `seqs` sequences
    score, padded     the same rows as one padded micro-batch [seqs, tokens / seqs]
    train, packed     the trainer's step: the actor with the frozen reference in lockstep, MicroBatch.loss_inputs,
                      stable_opd (opd + sft + exact ref_kl), backward
    train, padded     the same rows as one padded micro-batch (trainer.pack_sequences=false)
Memory is what torch allocates on the CPU during the call, from the profiler's allocation events
(torch.profiler, profile_memory=True: every allocation and free in time order; the peak of their running
sum), so the weights and anything allocated before the call are not counted. L = tokens x V x 2 bytes is one
bf16 logits tensor of the micro-batch; the table gives each peak in MB and in L.

Columns: "whole" and "fused" are this checkout with logits_chunk_tokens 0 and --chunk-tokens (default 128:
the share of the micro-batch that 1024, the trainer's default, is of a 16k-token micro-batch).
`--before REV` extracts megaopd/ of that git revision into a temporary directory (git archive) and measures it
in a subprocess with that PYTHONPATH; this checkout is measured the same way. Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("score, packed", "score, padded", "train, packed", "train, padded")


def allocations(fn):
    """(fn(), the bytes of every CPU allocation (+) and free (-) torch made while fn ran, in time order), from
    the profiler's allocation events (torch.profiler, profile_memory=True). Independent of what the
    allocator kept from earlier work, unlike RSS."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    return out, [e.nbytes() for e in events]


def _peak_bytes(fn) -> int:
    """The peak of (bytes allocated - bytes freed) on the CPU while fn() runs."""
    live = peak = 0
    for nbytes in allocations(fn)[1]:
        live += nbytes
        peak = max(peak, live)
    return peak


def _median_seconds(fn, reps: int = 3) -> float:
    """Median wall time of fn() over reps calls (after the warm-up measure() already ran)."""
    import statistics
    import time

    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(vocab: int, tokens: int, seqs: int, chunk_mib: float, chunk_tokens: int = 0, time_reps: int = 3) -> dict:
    """Peak bytes of each case (runs in the process whose PYTHONPATH holds the megaopd to measure), and under
    "seconds" the median time of each over time_reps calls (0: not timed)."""
    import torch

    import megaopd.ops._common as ops_common

    # The ops' float32 chunk, scaled down with the micro-batch: at 16k tokens x 152k ids the default 128 MiB
    # is 1.3% of a float32 copy of the logits; at the default size here 4 MiB is about that share.
    ops_common.DEFAULT_CHUNK_BYTES = int(chunk_mib * 2**20)

    from megaopd.batching.micro_batches import MicroBatch, ScoringBatches, StepCounts
    from megaopd.batching.packing import PackedRow, Segment
    from megaopd.losses import build_loss, loss_input
    from megaopd.models.builder import BuildOptions, build_gpt_model
    from megaopd.models.hf_config import read_hf_config
    from megaopd.parallel.dist import destroy_distributed, init_distributed
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.scoring import PipelineRunner
    from megaopd.scoring.passes import ScoreRequest, score_tokens

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hf = read_hf_config(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": tokens,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        }
    )
    L = tokens // seqs
    tokens_BS = torch.randint(3, vocab, (seqs, L))
    init_distributed()
    try:
        pgs = initialize_actor_layout(Layout(1, 1), seed=1)
        actor = build_gpt_model(hf, Layout(), pgs, BuildOptions(dtype="bfloat16")).train()
        reference = build_gpt_model(hf, Layout(), pgs, BuildOptions(dtype="bfloat16")).eval().requires_grad_(False)
        # An older revision's runner has no logits_chunk_tokens: only pass it when chunking.
        chunk = {"logits_chunk_tokens": chunk_tokens} if chunk_tokens else {}
        runner = PipelineRunner(actor, pgs, vocab, **chunk)
        train_runner = PipelineRunner(actor, pgs, vocab, partner=reference, **chunk)
        loss_fn = build_loss("stable_opd")
        lengths_B = torch.full((seqs,), L)

        def score(packed: bool):
            with torch.no_grad():
                score_tokens(
                    runner,
                    tokens_BS,
                    ScoringBatches(seqs, tokens if packed else None, lengths_B),
                    ScoreRequest(1.0, entropy=True),
                )

        row = PackedRow([Segment(0, b, L) for b in range(seqs)], tokens)
        T = tokens - 1
        half = (torch.arange(T) % L) >= L // 2  # response: the second half of each sequence
        mb = MicroBatch(
            tokens_BS=row.tokens({0: tokens_BS}, 0),
            loss_mask_BT=half[None].float(),
            golden_mask_BT=(~half)[None].float(),
            counts=StepCounts(T / 2, seqs, T / 2, seqs),
            inputs={
                loss_input("old_logprobs_BT"): -torch.rand(1, T),
                loss_input("teacher_logprobs_BT"): -torch.rand(1, T),
            },
            seq_ids_BT=row.seq_ids(),
            packed=row,
        )

        Tp = L - 1
        half_BT = (torch.arange(Tp) >= L // 2).expand(seqs, Tp)
        padded = MicroBatch(
            tokens_BS=tokens_BS,
            loss_mask_BT=half_BT.float(),
            golden_mask_BT=(~half_BT).float(),
            counts=StepCounts(T / 2, seqs, T / 2, seqs),
            inputs={
                loss_input("old_logprobs_BT"): -torch.rand(seqs, Tp),
                loss_input("teacher_logprobs_BT"): -torch.rand(seqs, Tp),
            },
        )

        def step_fn(m, logits_BSv, partner_BSv):
            loss = loss_fn(m.loss_inputs(logits_BSv, partner_BSv, pgs.tp, 1.0, loss_fn.needs)).total
            return loss, None

        def train(m):
            train_runner.run([m], step_fn, forward_only=False)
            for p in actor.parameters():  # megatron's main_grad buffers are not in use here: plain .grad
                p.grad = None

        cases = {
            "score, packed": lambda: score(True),
            "score, padded": lambda: score(False),
            "train, packed": lambda: train(mb),
            "train, padded": lambda: train(padded),
        }
        for fn in cases.values():  # warm-up: lazy buffers (rope cache), first-call allocations
            fn()
        peaks = {name: _peak_bytes(fn) for name, fn in cases.items()}
        if not time_reps:
            return peaks
        return {**peaks, "seconds": {name: _median_seconds(fn, time_reps) for name, fn in cases.items()}}
    finally:
        destroy_distributed()


def _measure_in(path: str, args, chunk_tokens: int = 0) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            f"--vocab={args.vocab}",
            f"--tokens={args.tokens}",
            f"--seqs={args.seqs}",
            f"--chunk-mib={args.chunk_mib}",
            f"--chunk-tokens={chunk_tokens}",
        ],
        env=env,
        cwd=path,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _checkout(rev: str, into: str) -> str:
    archive = os.path.join(into, "src.tar")
    subprocess.run(["git", "archive", "-o", archive, rev, "megaopd"], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="", help="a git revision to compare with too (default: none)")
    ap.add_argument("--chunk-tokens", type=int, default=128, help="tokens per logits chunk of the fused column")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument(
        "--chunk-mib",
        type=float,
        default=4.0,
        help="the ops' float32 chunk (megaopd.ops DEFAULT_CHUNK_BYTES, 128 MiB on a GPU), in MiB",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokens % args.seqs:
        ap.error("--tokens must be a multiple of --seqs")
    if args.worker:
        print(json.dumps(measure(args.vocab, args.tokens, args.seqs, args.chunk_mib, args.chunk_tokens)))
        return
    logits = args.tokens * args.vocab * 2
    runs = {}
    with tempfile.TemporaryDirectory(prefix="megaopd_mem_") as tmp:
        if args.before:
            runs[f"before ({args.before})"] = _measure_in(_checkout(args.before, tmp), args)
        runs["whole"] = _measure_in(ROOT, args)
        runs[f"fused ({args.chunk_tokens})"] = _measure_in(ROOT, args, args.chunk_tokens)
    print(
        f"V={args.vocab}, {args.tokens} tokens ({args.seqs} x {args.tokens // args.seqs}), bf16; "
        f"L = one bf16 logits tensor = {logits / 2**20:.0f} MiB; ops chunk {args.chunk_mib:g} MiB float32"
    )
    names = list(runs)
    head = f"{'case':<16}" + "".join(f"{n + ' MiB':>20}{'L':>6}" for n in names)
    print(head + f"{'fused/whole':>13}")
    whole, fused = names[-2], names[-1]
    for case in CASES:
        line = f"{case:<16}" + "".join(f"{runs[n][case] / 2**20:>20.0f}{runs[n][case] / logits:>6.2f}" for n in names)
        print(line + f"{runs[fused][case] / runs[whole][case]:>13.2f}")
    # Time too (median of 3 after a warm-up; one thread; the runs follow each other, so load changes between
    # them show): the fused path makes each chunk's logits again in backward.
    print(
        f"\n{'case':<16}" + "".join(f"{n + ' s':>20}" for n in names if "seconds" in runs[n]) + f"{'fused/whole':>13}"
    )
    for case in CASES:
        line = f"{case:<16}" + "".join(f"{runs[n]['seconds'][case]:>20.3f}" for n in names if "seconds" in runs[n])
        print(line + f"{runs[fused]['seconds'][case] / runs[whole]['seconds'][case]:>13.2f}")


if __name__ == "__main__":
    main()
