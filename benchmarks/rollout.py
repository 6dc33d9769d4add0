"""Rollout benchmarks: embedded-engine generation throughput, and weight-update bandwidth vs raw broadcast.

    python benchmarks/rollout.py                 # both, prints a markdown table
    python benchmarks/rollout.py --only gen      # or --only sync

Generation: EmbeddedEngine on a random Qwen2 (hidden 256, 4 layers, vocab 8192, built in a temp dir)
generating 64 new tokens (ignore_eos) for 1, 8 and 64 concurrent sequences of 32-token prompts;
tokens/s = generated tokens / wall time, median of --repeats runs after a warm-up.

Weight update: a helper process runs `megaopd serve`'s RolloutServer (thread) on a random Qwen2
(hidden 512, 8 layers, vocab 32000: ~180 MB in float32); this process is the trainer (rank 0) and
sends all HF tensors with DistributedWeightUpdater (HTTP metadata + gloo broadcast + load by name).
The reference is raw dist.broadcast of the same bytes with the same broadcasts (one per bucket, or one
per tensor) over the same group, sent from tensors already flat and received by the helper's main
thread into buffers it allocated once (the best case). ratio = update GB/s / raw GB/s.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def build_model(path: str, hidden: int, layers: int, vocab: int, seed: int = 0) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=2, pad_token_id=0)
    Qwen2ForCausalLM(cfg).float().save_pretrained(path)
    return path


def bench_generation(repeats: int, threads: list[int], new_tokens: int = 64, prompt_len: int = 32) -> list[dict]:
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.rollout.protocol import SamplingParams

    rows = []
    with tempfile.TemporaryDirectory() as d:
        build_model(d, hidden=256, layers=4, vocab=8192)
        engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=d, max_batch_size=64, load_tokenizer=False))
        g = torch.Generator().manual_seed(0)
        for n_threads, batch in [(n, b) for n in threads for b in (1, 8, 64)]:
            torch.set_num_threads(n_threads)
            prompts = torch.randint(3, 8192, (batch, prompt_len), generator=g).tolist()
            params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_p=0.95, ignore_eos=True, seed=1)
            engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = engine.generate(prompts, params)
                times.append(time.perf_counter() - t0)
                assert sum(len(s.output_ids) for s in out) == batch * new_tokens
            t = statistics.median(times)
            rows.append({"threads": n_threads, "sequences": batch, "tokens": batch * new_tokens, "seconds": t,
                         "tokens_per_s": batch * new_tokens / t})
            print(f"gen  threads={n_threads} B={batch:3d}: {batch * new_tokens / t:9.1f} tok/s ({t:.2f}s)", flush=True)
    return rows


def _server_process(model_dir: str, to_parent, from_parent):
    """Helper: a RolloutServer in a thread; on request, raw receives on its weight-update group."""
    torch.set_num_threads(1)
    from megaopd.serving.server import RolloutServer, ServeConfig
    from megaopd.parallel import custom_group as dist_group

    server = RolloutServer(ServeConfig(hf_dir=model_dir, port=0))
    server.load_engine()
    server.start()
    to_parent.put(server.url)
    cache: dict[tuple, list[torch.Tensor]] = {}
    while True:
        cmd = from_parent.get()
        if cmd[0] == "raw":
            _, group_name, sizes = cmd
            pg = server.weights.groups[group_name]
            # Buffers allocated and touched once, reused by every repeat: the best case for raw.
            bufs = cache.setdefault(tuple(sizes), [torch.zeros(n, dtype=torch.uint8) for n in sizes])
            to_parent.put("ready")
            for work in [dist_group.broadcast(b, pg, async_op=True) for b in bufs]:
                work.wait()
            to_parent.put("done")
        else:
            server.shutdown()
            return


def bench_weight_update(repeats: int, bucket_sizes_mb: list[int]) -> list[dict]:
    """One row per (load_format, bucket size); raw = the same broadcasts (per bucket or per tensor)."""
    from megaopd.rollout.client import HttpEngine
    from megaopd.rollout import weight_wire as wire
    from megaopd.parallel import custom_group as dist_group
    from megaopd.sync.distributed import DistributedUpdateConfig, DistributedWeightUpdater
    from transformers import AutoModelForCausalLM

    rows = []
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        build_model(d, hidden=512, layers=8, vocab=32000, seed=1)
        state = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).state_dict()
        named = [(k, v.detach().clone() + 0.001) for k, v in state.items()]
        total = sum(t.numel() * t.element_size() for _, t in named)
        to_parent, from_parent = ctx.Queue(), ctx.Queue()
        helper = ctx.Process(target=_server_process, args=(d, to_parent, from_parent), daemon=True)
        helper.start()
        try:
            url = to_parent.get(timeout=300)
            client = HttpEngine(url)
            for fmt, mb in [("flattened_bucket", mb) for mb in bucket_sizes_mb] + [(None, max(bucket_sizes_mb))]:
                upd = DistributedWeightUpdater([client], DistributedUpdateConfig(
                    bucket_bytes=mb << 20, timeout_s=300, load_format=fmt))
                upd.connect()
                upd.update(named, weight_version="warm")
                # Raw: the same broadcasts (bucket bytes pre-flattened, or each tensor) over the same group.
                if fmt == "flattened_bucket":
                    buckets = [wire.flatten_bucket([t for _, t in b]) for b in wire.buckets(named, mb << 20)]
                else:
                    buckets = [t.reshape(-1).view(torch.uint8) for _, t in named]
                times, raw_times = [], []
                for r in range(repeats):  # interleaved, so both see the same machine load
                    t0 = time.perf_counter()
                    upd.update(named, weight_version=f"r{r}")
                    times.append(time.perf_counter() - t0)
                    from_parent.put(("raw", upd.group_name, [b.numel() for b in buckets]))
                    assert to_parent.get(timeout=60) == "ready"
                    t0 = time.perf_counter()
                    # Issued back to back and then awaited, as the updater does.
                    works = [dist_group.broadcast(b, upd.pg, async_op=True) for b in buckets]
                    for w in works:
                        w.wait()
                    assert to_parent.get(timeout=300) == "done"
                    raw_times.append(time.perf_counter() - t0)
                upd.close()
                t, tr = statistics.median(times), statistics.median(raw_times)
                row = {"load_format": fmt or "per-tensor", "bucket_mb": mb, "broadcasts": len(buckets), "bytes": total, "update_s": t, "raw_s": tr,
                       "update_gbps": total / t / 1e9, "raw_gbps": total / tr / 1e9, "ratio": tr / t}
                rows.append(row)
                print(f"sync {row['load_format']} bucket={mb:4d} MB x{len(buckets):3d}: update {row['update_gbps']:.3f} GB/s, "
                      f"raw {row['raw_gbps']:.3f} GB/s, ratio {row['ratio']:.2f}", flush=True)
        finally:
            from_parent.put(("stop",))
            helper.join(timeout=30)
            if helper.is_alive():
                helper.kill()
    return rows


def markdown(gen: list[dict], sync: list[dict]) -> str:
    lines = []
    if gen:
        lines += ["| torch threads | concurrent sequences | generated tokens | seconds | tokens/s |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['threads']} | {r['sequences']} | {r['tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} |"
                  for r in gen]
        lines.append("")
    if sync:
        lines += ["| load_format | bucket | broadcasts | MB sent | update GB/s | raw broadcast GB/s | ratio |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['load_format']} | {r['bucket_mb']} MB | {r['broadcasts']} | {r['bytes'] / 1e6:.0f} | "
                  f"{r['update_gbps']:.3f} | {r['raw_gbps']:.3f} | {r['ratio']:.2f} |" for r in sync]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["gen", "sync"], default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch intra-op threads for generation")
    args = ap.parse_args(argv)
    gen = bench_generation(args.repeats, args.threads) if args.only in (None, "gen") else []
    sync = bench_weight_update(args.repeats, args.bucket_mb) if args.only in (None, "sync") else []
    print(markdown(gen, sync))


if __name__ == "__main__":
    main()
