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

Rollout data per rank (`rollout_bytes`): "before" is what every rank held after the old scoring (the whole
batch's [B, T] float32 log-probs and [B, T, K] top-K log-probs + int64 ids, assembled by a world all-reduce);
"after" is what a rank holds now: the replicated record (tokens, loss mask, engine log-probs) plus the
scores of the rows its actor replica trains, ids int32 (measured: the tensors' bytes after real actor and
teacher passes in gloo workers); "ragged" would keep only those rows' real positions. Measured at the CPU
batch, computed at 256 x 8192 x K=32.

    python benchmarks/packing.py                        # scale 1/16, 32 sequences per step
    python benchmarks/packing.py --rollout-bytes-only   # only the rollout-data tables
    python benchmarks/packing.py --rollout-modes-only   # only bytes per rank per rollout.mode (issue 25)
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

from megaopd.gpucheck.build import opd_lengths  # noqa: E402


def synthetic_rollout(prompt_lens, response_lens, vocab: int):
    from megaopd.rollout.records import RolloutBatch

    B, S = len(prompt_lens), max(p + r for p, r in zip(prompt_lens, response_lens))
    g = torch.Generator().manual_seed(1)
    tokens = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S - 1)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        tokens[b, : p + r] = torch.randint(1, vocab, (p + r,), generator=g)
        mask[b, p - 1 : p + r - 1] = 1
    return RolloutBatch(
        tokens_BS=tokens,
        loss_mask_BT=mask,
        engine_logprobs_BT=torch.zeros(B, S - 1),
        prompt_lens_B=torch.tensor(prompt_lens),
        response_lens_B=torch.tensor(response_lens),
        finish_reasons=["stop"] * B,
        group_ids_B=torch.arange(B),
    )


def _worker(rank, world, hf_dir, mode, prompt_lens, response_lens, mbs, max_tokens, repeats):
    torch.set_num_threads(1)
    from megaopd import ops
    from megaopd.batching.micro_batches import MiniBatch, assemble_micro_batches, assemble_packed_micro_batches
    from megaopd.batching.settings import Packing
    from megaopd.losses import LossNeeds
    from megaopd.models.builder import build_gpt_model
    from megaopd.models.hf_config import read_hf_config
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.scoring.runner import PipelineRunner

    pgs = initialize_actor_layout(Layout(world, 1))  # TP = world, one DP replica: the whole batch per rank
    cfg = read_hf_config(hf_dir)
    model = build_gpt_model(cfg, Layout(tp=world), pgs)
    rollout = synthetic_rollout(prompt_lens, response_lens, cfg.vocab_size)
    rows, needs = torch.arange(rollout.size), LossNeeds()
    mini = MiniBatch(rollout, rollout.loss_mask_BT, None, rows, None)
    if mode == "packed":
        micro = assemble_packed_micro_batches(mini, 0, 1, needs, Packing(max_tokens=max_tokens, pad_id=0))
    else:
        micro = assemble_micro_batches(mini, 0, 1, needs, mbs, 0)
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
    return dict(
        useful=real / processed,
        time=statistics.median(times),
        peak_mb=peak / 1024,
        step_mb=(peak - base) / 1024,
        micro=len(micro),
    )


def rollout_bytes(lengths: list[int], S: int, K: int, dp: int) -> dict[str, float]:
    """Bytes of rollout data per rank, computed from the shapes. Every layout keeps the replicated record
    (int64 tokens [B, S], float32 loss mask and engine log-probs [B, T]). Scores (actor and teacher float32
    log-probs [., T], teacher top-K float32 log-probs + ids [., T, K]):
      before: every rank the whole batch, zero-padded, ids int64 (the world all-reduce of the old passes);
      owner:  the rows its DP replica trains (about B / DP of them, each [T] wide), ids int32 (this branch);
      ragged: those rows' real positions only (length - 1 each), not padded to T (a further step)."""
    B, T = len(lengths), S - 1
    replicated = B * S * 8 + 2 * B * T * 4
    per_position = (2 * 4 + K * (4 + 8), 2 * 4 + K * (4 + 4))  # bytes per position: before, after
    owned_rows = -(-B // dp)
    real = sum(n - 1 for n in lengths)
    return {
        "before": replicated + B * T * per_position[0],
        "owner": replicated + owned_rows * T * per_position[1],
        "ragged": replicated + real / dp * per_position[1],
        "replicated": replicated,
    }


def _bytes_of(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _bytes_worker(rank, world, hf_dir, prompt_lens, response_lens, actor_tp, teacher_tp, K):
    """Scores the synthetic rollout as the trainer does (actor in its layout, teacher in another, owners from
    row_owners' packed partition) and returns the bytes this rank holds: replicated record + its scores."""
    torch.set_num_threads(1)
    from megaopd.batching.micro_batches import ScoringBatches
    from megaopd.batching.owners import RowOwners
    from megaopd.batching.settings import BatchingSettings
    from megaopd.batching.shares import row_owners
    from megaopd.losses import LossNeeds
    from megaopd.models.config import ModelConfig
    from megaopd.parallel.groups import Layout, build_process_groups, initialize_actor_layout
    from megaopd.scoring.passes import ScoreRequest, score_tokens
    from megaopd.scoring.runner import PipelineRunner
    from megaopd.trainer.roles import load_role_model

    pgs = initialize_actor_layout(Layout(actor_tp, 1))
    actor = load_role_model(ModelConfig(path=hf_dir, tp=actor_tp), pgs, trainable=False)
    tpgs = build_process_groups(Layout(teacher_tp, 1))
    teacher = load_role_model(ModelConfig(path=hf_dir, tp=teacher_tp), tpgs, trainable=False)
    V = actor.hf.vocab_size
    rollout = synthetic_rollout(prompt_lens, response_lens, V)
    settings = BatchingSettings(
        prompts_per_step=rollout.size, mini_batches=1, micro_batch_size=4, pad_id=0, max_tokens=4096
    )
    owners = RowOwners(
        tuple(row_owners(rollout, None, pgs.dp.size(), LossNeeds(), settings)),
        pgs.dp.rank(),
        pgs.dp.size(),
        pgs.tp.rank() == 0,
    )
    batches = ScoringBatches(4, 4096, rollout.prompt_lens_B + rollout.response_lens_B)
    a = score_tokens(PipelineRunner(actor.model, pgs, V), rollout.tokens_BS, batches, ScoreRequest(1.0), owners=owners)
    t = score_tokens(
        PipelineRunner(teacher.model, tpgs, V), rollout.tokens_BS, batches, ScoreRequest(1.0, topk=K), owners=owners
    )
    replicated = _bytes_of(rollout.tokens_BS, rollout.loss_mask_BT, rollout.engine_logprobs_BT)
    return {
        "replicated": replicated,
        "held": replicated + _bytes_of(a.logprobs_BT, t.logprobs_BT, t.topk_ids_BTK, t.topk_logprobs_BTK),
        "rows": len(a.rows),
    }


def measure_rollout_bytes(hf_dir: str, prompt_lens, response_lens, K: int = 32) -> list[tuple]:
    """(world, actor layout, teacher layout, max bytes held by a rank, computed `before` bytes) per layout."""
    from megaopd.parallel.launch import spawn

    lengths = [p + r for p, r in zip(prompt_lens, response_lens)]
    out = []
    for world, actor_tp, teacher_tp in ((2, 2, 1), (2, 1, 2), (4, 1, 2)):
        res = spawn(
            _bytes_worker, world, args=(hf_dir, prompt_lens, response_lens, actor_tp, teacher_tp, K), timeout=3000
        )
        computed = rollout_bytes(lengths, max(lengths), K, world // actor_tp)
        out.append((world, actor_tp, teacher_tp, max(r["held"] for r in res), computed))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--scale", type=float, default=1 / 16)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=0, help="packed budget; default micro_batch_size x the longest")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--rollout-bytes-only", action="store_true", help="only the rollout-data tables")
    ap.add_argument("--rollout-modes-only", action="store_true", help="only the per-mode table (no workers)")
    a = ap.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megaopd.parallel.launch import spawn

    prompt_lens, response_lens = opd_lengths(a.sequences, a.scale)
    lengths = [p + r for p, r in zip(prompt_lens, response_lens)]
    max_tokens = a.max_tokens or a.micro_batch_size * max(lengths)
    if a.rollout_modes_only:
        return print_rollout_bytes_per_mode(prompt_lens, response_lens, a.sequences)
    if a.rollout_bytes_only:
        print_rollout_bytes(prompt_lens, response_lens, a.sequences)
        return print_rollout_bytes_per_mode(prompt_lens, response_lens, a.sequences)
    print(
        f"{a.sequences} sequences, lengths {min(lengths)}..{max(lengths)} (mean {statistics.mean(lengths):.0f}), "
        f"micro_batch_size {a.micro_batch_size}, max_tokens {max_tokens}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=2048,
                hidden_size=256,
                intermediate_size=688,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=2,
                max_position_embeddings=8192,
                tie_word_embeddings=False,
            )
        ).save_pretrained(tmp)
        rows = []
        for tp in [int(x) for x in a.tps.split(",")]:
            res = {
                mode: spawn(
                    _worker,
                    tp,
                    args=(tmp, mode, prompt_lens, response_lens, a.micro_batch_size, max_tokens, a.repeats),
                    timeout=3000,
                )[0]
                for mode in ("padded", "packed")
            }
            rows.append((tp, res))
    print("| TP | mode | micro-batches | useful tokens | step s | peak RSS MB | step's RSS growth MB |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for tp, res in rows:
        for mode, r in res.items():
            print(
                f"| {tp} | {mode} | {r['micro']} | {r['useful']:.0%} | {r['time']:.2f} | {r['peak_mb']:.0f} | "
                f"{r['step_mb']:.0f} |"
            )
    for tp, res in rows:
        p, q = res["padded"], res["packed"]
        print(
            f"TP={tp}: packed/padded step time {q['time'] / p['time']:.2f}, peak RSS "
            f"{q['peak_mb'] / p['peak_mb']:.2f}, "
            f"useful-token fraction {p['useful']:.0%} -> {q['useful']:.0%}"
        )
    print_rollout_bytes(prompt_lens, response_lens, a.sequences)
    print_rollout_bytes_per_mode(prompt_lens, response_lens, a.sequences)


def print_rollout_bytes(prompt_lens, response_lens, sequences: int) -> None:
    """The rollout-data table: measured at the CPU batch (max over ranks of the bytes a rank holds after the
    actor's and the teacher's passes), computed at 256 x 8192 x K=32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    lengths = [p + r for p, r in zip(prompt_lens, response_lens)]
    S = max(lengths)
    print("| batch | layout | before: every rank | after: max over ranks | of it replicated | ragged (next step) |")
    print("|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=2048,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=8192,
                tie_word_embeddings=False,
            )
        ).save_pretrained(tmp)
        for world, atp, ttp, held, c in measure_rollout_bytes(tmp, prompt_lens, response_lens):
            print(
                f"| CPU {sequences} x {S}, K=32, measured | world {world}: actor TP={atp} DP={world // atp}, teacher "
                f"TP={ttp} DP={world // ttp} | {c['before'] / 2**20:.2f} MiB | {held / 2**20:.2f} MiB | "
                f"{c['replicated'] / 2**20:.2f} MiB | {c['ragged'] / 2**20:.2f} MiB |"
            )
    big_p, big_r = opd_lengths(256, 1.0, seed=3)
    big = [p + r for p, r in zip(big_p, big_r)]
    for dp in (1, 8, 64):
        c = rollout_bytes(big, 8192 + 300, 32, dp)
        print(
            f"| 256 x 8492, K=32, computed (OPD lengths) | DP={dp} | {c['before'] / 2**30:.3f} GiB | "
            f"{c['owner'] / 2**30:.3f} GiB | {c['replicated'] / 2**30:.3f} GiB | {c['ragged'] / 2**30:.3f} GiB |"
        )


def sample_transport_bytes(prompt_lens, response_lens, vocab: int = 151_936) -> dict[str, float]:
    """What a step's samples cost on their way from the engines to the ranks, measured on Samples of these
    lengths (ids drawn below `vocab`, float log-probs): `sent`, the pickle rank 0 broadcasts to every rank
    (megaopd.parallel.dist.rank0_computes); `in_flight`, the Python objects one batch generated ahead keeps
    on rank 0 (tracemalloc of building them: a list of ints is ~36 bytes an id, not 4)."""
    import pickle
    import random
    import tracemalloc

    from megaopd.rollout.protocol import Sample

    rng = random.Random(0)
    tracemalloc.start()
    samples = [
        Sample(
            [rng.randrange(vocab) for _ in range(p)],
            [rng.randrange(vocab) for _ in range(r)],
            [-rng.random() for _ in range(r)],
            "stop",
            "3",
        )
        for p, r in zip(prompt_lens, response_lens)
    ]
    in_flight = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"sent": float(len(pickle.dumps(samples, protocol=pickle.HIGHEST_PROTOCOL))), "in_flight": float(in_flight)}


def delivered_bytes(lengths: list[int], dp: int) -> dict[str, float]:
    """Computed: what a rank other than 0 receives per step with batching.delivery at actor DP=dp (teacher in
    the actor's layout): the [B, 9] int64 header, and its replica's rows' real tokens at 12 bytes each (id,
    loss mask, engine log-prob), the rows balanced over DP by tokens (the packed row_owners)."""
    from megaopd.batching.shares import balanced_partition

    shares = balanced_partition([[n] for n in lengths], dp)
    return {"header": 16.0 + 9 * 8 * len(lengths), "rows": 12.0 * max(sum(lengths[i] for i in s) for s in shares)}


def _delivery_worker(rank, world, prompt_lens, response_lens):
    """Measured: the real delivery of the synthetic rollout at actor DP=world (TP=1), owners from row_owners'
    packed partition. Returns the bytes this rank received (header tensors + rows)."""
    from megaopd.batching.delivery import broadcast_header, deliver_rows, row_users
    from megaopd.batching.owners import RankPlace, RowOwners, WorldLayout
    from megaopd.batching.settings import BatchingSettings
    from megaopd.batching.shares import row_owners
    from megaopd.losses import LossNeeds
    from megaopd.parallel.dist import device

    batch = broadcast_header(lambda: synthetic_rollout(prompt_lens, response_lens, 151_936), 0, 1, device())
    settings = BatchingSettings(
        prompts_per_step=batch.size, mini_batches=1, micro_batch_size=4, pad_id=0, max_tokens=4096
    )
    layout = WorldLayout(tuple(RankPlace(r, True) for r in range(world)))
    owners = RowOwners(tuple(row_owners(batch, None, world, LossNeeds(), settings)), rank, world, True, layout)
    rows = deliver_rows(batch, row_users(owners, layout), device())
    return {"header": 16 + batch.size * 9 * 8 if rank else 0, "rows": rows}


def print_rollout_bytes_per_mode(prompt_lens, response_lens, sequences: int) -> None:
    """Issue 25 item 5: bytes per rank in each rollout.mode. Before batching.delivery every rank received the
    step's samples (rank 0's pickle of them); now a rank receives the header and its replica's rows as
    tensors, the same in every mode (measured at the CPU batch in gloo workers, computed at the paper's).
    Rank 0 alone keeps the batches generated ahead (one_step_off: 1, async: max_staleness) as Python objects
    until they are taken."""
    from megaopd.parallel.launch import spawn

    big_p, big_r = opd_lengths(256, 1.0, seed=3)
    cases = [
        (
            f"CPU {sequences} x {max(p + r for p, r in zip(prompt_lens, response_lens))}",
            prompt_lens,
            response_lens,
            (1, 2, 4),
            2**20,
            "MiB",
            True,
        ),
        ("256 x 8492 (OPD lengths)", big_p, big_r, (1, 8, 64), 2**30, "GiB", False),
    ]
    print(
        "| batch | DP | received per rank per step before (pickled samples), every mode | now (header + its rows "
        "as tensors), every mode | held per rank (record + owned scores, K=32), every mode | rank 0 also holds, "
        "batches in flight: sync / one_step_off / async 2 / async 4 |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for name, pl, rl, dps, unit, label, measure in cases:
        t = sample_transport_bytes(pl, rl)
        lengths = [p + r for p, r in zip(pl, rl)]
        ahead = " / ".join(f"{n * t['in_flight'] / unit:.3f}" for n in (0, 1, 2, 4))
        for dp in dps:
            held = rollout_bytes(lengths, max(lengths), 32, dp)["owner"]
            if measure and dp > 1:
                res = spawn(_delivery_worker, dp, args=(pl, rl), timeout=600)
                now = f"{max(r['header'] + r['rows'] for r in res[1:]) / unit:.3f} {label} measured"
            else:
                d = delivered_bytes(lengths, dp)
                now = f"{(d['header'] + d['rows']) / unit:.4f} {label} computed"
            print(
                f"| {name} | {dp} | {t['sent'] / unit:.3f} {label} | {now} | {held / unit:.3f} {label} | {ahead} "
                f"{label} |"
            )


if __name__ == "__main__":
    main()
