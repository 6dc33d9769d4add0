"""Packed sequences vs padding: useful-token fraction, step time and peak memory of a training step, and the
bytes of rollout data per rank.

A long-tailed batch mimics OPD rollouts (prompt 100-300 tokens; response lengths log-normal, mean about
3k, capped at 8k), scaled down by --scale so a CPU step takes seconds. One training step (forward +
backward, token-mean NLL over the response tokens) of a small random Qwen2 through the PipelineRunner:
    padded: every row padded to the batch's longest, micro_batch_size rows per micro-batch
            (assemble_micro_batches, trainer.pack_sequences=false)
    packed: whole sequences packed into rows of at most max_tokens tokens, DP shares balanced
            (assemble_packed_micro_batches, trainer.pack_sequences=true)
at TP=1 and TP=2 (gloo workers, one torch thread each). Each (mode, TP) runs in fresh processes so the
peak resident memory (ru_maxrss) of its step is its own.

useful-token fraction = real tokens / tokens through the model;  step time = median of --repeats steps.

Rollout data per rank: "before" is what every rank holds after today's scoring (the whole batch's
[B, T] float32 log-probs and [B, T, K] top-K log-probs + int64 ids, assembled by a world all-reduce);
"owner" is what the rank that trains a row needs: its rows' real positions only, ids int32, log-probs
float32, top-K ids int32. Measured at the CPU batch, computed at 256 x 8192 x K=32.

    python benchmarks/packing.py                # scale 1/16, 32 sequences per step
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402


def opd_lengths(n: int, scale: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """(prompt, response) lengths of n OPD-like rollouts: responses log-normal (median 2.2k, mean about
    3k), cut at 8k (the truncated tail), times scale."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, 300, (n,), generator=g).float()
    responses = torch.exp(torch.randn(n, generator=g) * 0.8 + 7.7).clamp(64, 8192)
    return ([max(2, int(p * scale)) for p in prompts.tolist()], [max(1, int(r * scale)) for r in responses.tolist()])


def synthetic_rollout(prompt_lens, response_lens, vocab: int):
    from megaopd.rollout.batch import RolloutBatch

    B, S = len(prompt_lens), max(p + r for p, r in zip(prompt_lens, response_lens))
    g = torch.Generator().manual_seed(1)
    tokens = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S - 1)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        tokens[b, :p + r] = torch.randint(1, vocab, (p + r,), generator=g)
        mask[b, p - 1:p + r - 1] = 1
    return RolloutBatch(tokens_BS=tokens, loss_mask_BT=mask, engine_logprobs_BT=torch.zeros(B, S - 1),
                        prompt_lens_B=torch.tensor(prompt_lens), response_lens_B=torch.tensor(response_lens),
                        finish_reasons=["stop"] * B, group_ids_B=torch.arange(B))


def _worker(rank, world, hf_dir, mode, prompt_lens, response_lens, mbs, max_tokens, repeats):
    torch.set_num_threads(1)
    from megaopd import ops
    from megaopd.losses import LossNeeds
    from megaopd.models.builder import build_gpt_model
    from megaopd.models.hf_config import read_hf_config
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.scoring.runner import PipelineRunner
    from megaopd.trainer.micro_batches import assemble_micro_batches, assemble_packed_micro_batches

    pgs = initialize_actor_layout(Layout(world, 1))  # TP = world, one DP replica: the whole batch per rank
    cfg = read_hf_config(hf_dir)
    model = build_gpt_model(cfg, world, 1, pg_collection=pgs)
    rollout = synthetic_rollout(prompt_lens, response_lens, cfg.vocab_size)
    rows, needs = torch.arange(rollout.size), LossNeeds()
    if mode == "packed":
        micro = assemble_packed_micro_batches(rollout, rollout.loss_mask_BT, None, rows, None, 0, 1, needs,
                                              max_tokens, 0)
    else:
        micro = assemble_micro_batches(rollout, rollout.loss_mask_BT, None, rows, None, 0, 1, needs, mbs, 0)
    n_tokens = float(rollout.loss_mask_BT.sum())

    def step_fn(mb, logits, _partner):
        lp = ops.vocab_parallel_logprobs(logits[:, :-1], mb.tokens_BS[:, 1:], pgs.tp)
        return -(lp * mb.loss_mask_BT).sum() / n_tokens, None

    runner = PipelineRunner(model, pgs, cfg.vocab_size)
    runner.run(micro[:1], step_fn, forward_only=False)  # warm-up
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        runner.run(micro, step_fn, forward_only=False)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    processed = sum(mb.tokens_BS.numel() for mb in micro)
    real = sum(p + r for p, r in zip(prompt_lens, response_lens))
    return dict(useful=real / processed, time=statistics.median(times), peak_mb=peak / 1024,
                step_mb=(peak - base) / 1024, micro=len(micro))


def rollout_bytes(lengths: list[int], S: int, K: int, dp: int) -> tuple[float, float]:
    """(before, owner) bytes per rank: every rank all of [B, T] + [B, T, K] zero-padded (fp32 log-probs of
    actor and teacher, teacher top-K fp32 log-probs + int64 ids, int64 tokens); vs a rank's balanced share
    of real positions with int32 ids."""
    B, T = len(lengths), S - 1
    before = B * S * 8 + 2 * B * T * 4 + B * T * K * (4 + 8)
    real = sum(lengths)
    owner = (real * 4 + 2 * (real - B) * 4 + (real - B) * K * (4 + 4)) / dp
    return before, owner


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--scale", type=float, default=1 / 16)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=0, help="packed budget; default micro_batch_size x the longest")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tps", default="1,2")
    a = ap.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megaopd.parallel.launch import spawn

    prompt_lens, response_lens = opd_lengths(a.sequences, a.scale)
    lengths = [p + r for p, r in zip(prompt_lens, response_lens)]
    max_tokens = a.max_tokens or a.micro_batch_size * max(lengths)
    print(f"{a.sequences} sequences, lengths {min(lengths)}..{max(lengths)} (mean {statistics.mean(lengths):.0f}), "
          f"micro_batch_size {a.micro_batch_size}, max_tokens {max_tokens}")
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                                     tie_word_embeddings=False)).save_pretrained(tmp)
        rows = []
        for tp in [int(x) for x in a.tps.split(",")]:
            res = {mode: spawn(_worker, tp, args=(tmp, mode, prompt_lens, response_lens, a.micro_batch_size,
                                                  max_tokens, a.repeats), timeout=3000)[0]
                   for mode in ("padded", "packed")}
            rows.append((tp, res))
    print("| TP | mode | micro-batches | useful tokens | step s | peak RSS MB | step's RSS growth MB |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for tp, res in rows:
        for mode, r in res.items():
            print(f"| {tp} | {mode} | {r['micro']} | {r['useful']:.0%} | {r['time']:.2f} | {r['peak_mb']:.0f} | "
                  f"{r['step_mb']:.0f} |")
    for tp, res in rows:
        p, q = res["padded"], res["packed"]
        print(f"TP={tp}: packed/padded step time {q['time'] / p['time']:.2f}, peak RSS {q['peak_mb'] / p['peak_mb']:.2f}, "
              f"useful-token fraction {p['useful']:.0%} -> {q['useful']:.0%}")
    S = max(lengths)
    before, owner = rollout_bytes(lengths, S, 32, 1)
    print(f"rollout data per rank at this batch (B={a.sequences}, S={S}, K=32, DP=1): {before / 2**20:.1f} MiB "
          f"-> {owner / 2**20:.1f} MiB")
    big_p, big_r = opd_lengths(256, 1.0, seed=3)
    big = [p + r for p, r in zip(big_p, big_r)]
    for dp in (1, 8, 64):
        before, owner = rollout_bytes(big, 8192 + 300, 32, dp)
        print(f"256 x 8192 x K=32, DP={dp}: {before / 2**30:.2f} GiB every rank -> {owner / 2**30:.3f} GiB per owner")


if __name__ == "__main__":
    main()
