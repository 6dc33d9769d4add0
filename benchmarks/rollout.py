"""Rollout benchmarks: embedded-engine generation throughput, and weight-update bandwidth vs raw broadcast.

    python benchmarks/rollout.py                 # both, prints markdown tables
    python benchmarks/rollout.py --only gen      # or --only sync
    python benchmarks/rollout.py --only schedule # the engine's decode steps and prefills per admit_min
    python benchmarks/rollout.py --only ops      # the operations one decode step runs, eager vs compile_decode

Generation (megaopd.gpucheck.engine_bench, whose table `python -m megaopd.gpucheck --bench engine` prints
too): the embedded engine beside transformers' `generate` (dynamic cache; static cache, compiled on CUDA)
and transformers' continuous batching, on the same random Qwen2 (hidden 256, 4 layers, vocab 32000,
built in a temp dir) and the same prompts (32 tokens), T=1, no filtering, EOS ignored:
  fixed  16 rows x 64 new tokens through 16 slots;
  mixed  48 rows with OPD-like budgets (the packing benchmark's length distribution, mean 64) through 16 slots.
One torch thread (--threads), runs interleaved, median of --repeats; ratios to `hf dynamic` and the
engine's mixed / fixed. --device cuda --dtype bfloat16 runs the same on a GPU. transformers' continuous
batching is ~10x slower than the rest on CPU, so --hf-cb-repeats (default 1) times it fewer times.

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
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=2,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(cfg).float().save_pretrained(path)
    return path


def bench_generation(
    repeats: int,
    threads: int,
    device: str = "cpu",
    dtype: str = "float32",
    slots: int = 16,
    new_tokens: int = 64,
    prompt_len: int = 32,
    which=None,
    cb_repeats: int = 1,
) -> str:
    from megaopd.gpucheck import engine_bench as eb

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as d:
        build_model(d, hidden=256, layers=4, vocab=32000)
        gens = eb.Generators(d, device, dtype, slots, which or eb.DEFAULT_GENERATORS)
        case_list = eb.cases(slots, prompt_len, new_tokens, 32000)
        slow = [g for g in gens.which if g == "hf cb"]
        gens.which = [g for g in gens.which if g not in slow]
        eb.measure(gens, case_list, repeats, log=lambda line: print("gen", line, flush=True))
        if slow:  # after the others' repeats, interleaved among themselves
            fast, gens.which = gens.which, slow
            eb.measure(gens, case_list, cb_repeats, log=lambda line: print("gen", line, flush=True))
            gens.which = fast + gens.which
    return (
        f"torch threads {threads}, {device}, {dtype}, {slots} slots, load average (1 min) at the end: "
        f"{os.getloadavg()[0]:.2f}\n\n" + eb.markdown(case_list, gens.errors)
    )


def bench_schedule(admits=(1, 2, 4, 8, 16), slots: int = 64, sync_every: int = 8) -> str:
    """The engine's schedule for the GPU check's cases (64 slots, 32-token prompts, 128 new tokens; mixed: 192
    OPD-like budgets), with the host reading finished rows every 8 steps as on CUDA: decode steps and
    prefills (counted by the profiler's engine.* ranges) per EmbeddedEngineConfig.admit_min. Counts, not
    times: the tiny model stands in for any. Cost = steps + c x prefills in decode-step units, for a
    prefill costing c steps (on the H100, 2026-11-24: an eager forward ~36 ms, a graph-replayed step ~10 ms)."""
    from torch.profiler import ProfilerActivity, profile

    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.engine.rows import RowRequest
    from megaopd.engine.runner import ModelRunner
    from megaopd.gpucheck import engine_bench as eb

    torch.set_num_threads(1)
    lines = [
        "| case | admit_min | decode steps | prefills | tokens / step | rate vs fixed, c=1 | c=4 |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as d:
        build_model(d, hidden=64, layers=1, vocab=512)
        fixed_rate = {}
        for case in eb.cases(slots, 32, 128, 512):
            rows = [
                RowRequest(prompt_ids=p, max_new_tokens=b, seed=i)
                for i, (p, b) in enumerate(zip(case.prompts, case.budgets))
            ]
            for admit in admits if case.name == "mixed" else (1,):
                engine = ModelRunner(
                    EmbeddedEngineConfig(
                        hf_dir=d,
                        device="cpu",
                        max_batch_size=slots,
                        load_tokenizer=False,
                        sync_every=sync_every,
                        admit_min=admit,
                    )
                )
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    engine.run(rows)
                calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith("engine.")}
                steps, prefills = calls.get("engine.sample", 0), calls.get("engine.prefill", 0)
                rate = {c: case.tokens / (steps + c * prefills) for c in (1, 4)}
                if case.name == "fixed":
                    fixed_rate = rate
                lines.append(
                    f"| {case.name} | {admit} | {steps} | {prefills} | {case.tokens / steps:.1f} | "
                    f"{rate[1] / fixed_rate[1]:.2f} | {rate[4] / fixed_rate[4]:.2f} |"
                )
    return "\n".join(lines)


def bench_step_ops(rows: int = 64, length: int = 256) -> str:
    """The operations one decode step of the engine runs (megaopd.engine.forward.Forward.step), eager and under
    compile_decode, at Qwen2.5-1.5B's depth and head layout (28 layers, 12 query heads on 2 KV heads) made
    narrow (hidden 192, vocabulary 1024): 64 rows attending 256 positions. A CUDA graph replays the same
    sequence of kernels, and a small kernel costs a few microseconds whatever its size, so at 64 rows the
    count, not the bytes, sets much of a graph-replayed step's time on a GPU. Counted with the profiler: leaf
    operations that compute (views and allocations left out), inductor's fused kernels named
    (config.cpp.enable_kernel_profile). CPU kernels stand in for CUDA ones, except the bias copies that CPU
    addmm makes (CUDA's adds the bias in the GEMM): they are counted apart."""
    import collections

    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megaopd.engine import attention
    from megaopd.engine.cache import PrefillCopy, SlotCache
    from megaopd.engine.forward import Forward

    inductor_config.cpp.enable_kernel_profile = True
    torch.set_num_threads(1)
    torch.manual_seed(0)
    name = attention.register()
    cfg = Qwen2Config(
        vocab_size=1024,
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = name
    model = Qwen2ForCausalLM(cfg).eval()
    shape_only = {
        "view",
        "reshape",
        "as_strided",
        "transpose",
        "unsqueeze",
        "slice",
        "select",
        "expand",
        "t",
        "_unsafe_view",
        "alias",
        "empty",
        "empty_strided",
        "detach",
        "squeeze",
        "permute",
        "lift_fresh",
        "_reshape_alias",
        "resolve_conj",
        "resolve_neg",
        "result_type",
        "empty_like",
    }

    def computes(e):
        return (e.name.startswith("aten::") and e.name[6:] not in shape_only) or "cpp_fused" in e.name

    def row(label, prof, seconds):
        children = collections.defaultdict(list)
        for e in prof.events():
            if e.cpu_parent is not None:
                children[e.cpu_parent.id].append(e)
        leaves = [e for e in prof.events() if computes(e) and not any(computes(c) for c in children[e.id])]
        fused = sum("cpp_fused" in e.name for e in leaves)
        gemms = sum(e.name in ("aten::mm", "aten::bmm", "aten::addmm") for e in leaves)
        bias = sum(
            e.name == "aten::copy_" and e.cpu_parent is not None and e.cpu_parent.name == "aten::addmm" for e in leaves
        )
        return (
            f"| {label} | {len(leaves)} | {fused} | {gemms} | {bias} | {len(leaves) - fused - gemms - bias} "
            f"| {seconds:.2f} |"
        )

    lines = [
        "| forward | operations | fused kernels | GEMMs | bias copies (CPU only) | other "
        "| s (decode: to first step; prefill: median of 3) |",
        "|---|---|---|---|---|---|---|",
    ]
    # The prefill that admits the rows: distinct 32-token prompts, each copied into its slot in every layer.
    prompts = [[5 + i] * 32 for i in range(rows)]
    copies = [PrefillCopy(u=i, slot=i, pad=0, length=32) for i in range(rows)]
    for compiled in (False, True):
        fwd = Forward(model, torch.device("cpu"), 0, "past_key_values", compile=compiled)
        cache = SlotCache(model.config, rows, 2 * length, torch.device("cpu"), torch.float32)
        tok, rows_A = torch.ones(rows, dtype=torch.long), torch.arange(rows)
        with torch.inference_mode():
            if not compiled:  # prefill is eager in both arms
                seconds = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    fwd.prefill(cache, prompts, copies)
                    seconds.append(time.perf_counter() - t0)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    fwd.prefill(cache, prompts, copies)
                lines.append(row(f"prefill, {rows} rows x 32 tokens", prof, sorted(seconds)[1]))
            fwd.prefill(cache, prompts, copies)
            t0 = time.perf_counter()
            fwd.step(cache, tok, torch.full((rows,), 32), rows_A, length)
            first = time.perf_counter() - t0
            fwd.step(cache, tok, torch.full((rows,), 33), rows_A, length)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fwd.step(cache, tok, torch.full((rows,), 34), rows_A, length)
        lines.append(row(f"decode step, {'compile_decode' if compiled else 'eager'}", prof, first))
    return "\n".join(lines)


def _server_process(model_dir: str, to_parent, from_parent):
    """Helper: a RolloutServer in a thread; on request, raw receives on its weight-update group."""
    torch.set_num_threads(1)
    from megaopd.parallel import custom_group as dist_group
    from megaopd.serving.server import RolloutServer, ServeConfig

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
    from transformers import AutoModelForCausalLM

    from megaopd.parallel import custom_group as dist_group
    from megaopd.rollout import weight_wire as wire
    from megaopd.rollout.client import HttpEngine
    from megaopd.sync.distributed import DistributedUpdateConfig, DistributedWeightUpdater

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
                upd = DistributedWeightUpdater(
                    [client], DistributedUpdateConfig(bucket_bytes=mb << 20, timeout_s=300, load_format=fmt)
                )
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
                row = {
                    "load_format": fmt or "per-tensor",
                    "bucket_mb": mb,
                    "broadcasts": len(buckets),
                    "bytes": total,
                    "update_s": t,
                    "raw_s": tr,
                    "update_gbps": total / t / 1e9,
                    "raw_gbps": total / tr / 1e9,
                    "ratio": tr / t,
                }
                rows.append(row)
                print(
                    f"sync {row['load_format']} bucket={mb:4d} MB x{len(buckets):3d}: update "
                    f"{row['update_gbps']:.3f} GB/s, "
                    f"raw {row['raw_gbps']:.3f} GB/s, ratio {row['ratio']:.2f}",
                    flush=True,
                )
        finally:
            from_parent.put(("stop",))
            helper.join(timeout=30)
            if helper.is_alive():
                helper.kill()
    return rows


def markdown(gen: str, sync: list[dict]) -> str:
    lines = [gen, ""] if gen else []
    if sync:
        lines += [
            "| load_format | bucket | broadcasts | MB sent | update GB/s | raw broadcast GB/s | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['load_format']} | {r['bucket_mb']} MB | {r['broadcasts']} | {r['bytes'] / 1e6:.0f} | "
            f"{r['update_gbps']:.3f} | {r['raw_gbps']:.3f} | {r['ratio']:.2f} |"
            for r in sync
        ]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["gen", "sync", "schedule", "ops"], default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for generation")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--generators",
        default=None,
        help="comma-separated subset of engine,engine compiled,hf dynamic,hf static,hf cb "
        "(default: all but engine compiled)",
    )
    ap.add_argument("--hf-cb-repeats", type=int, default=1)
    args = ap.parse_args(argv)
    which = args.generators.split(",") if args.generators else None
    if args.only == "schedule":
        print(bench_schedule())
        return
    if args.only == "ops":
        print(bench_step_ops())
        return
    gen = (
        bench_generation(
            args.repeats, args.threads, args.device, args.dtype, which=which, cb_repeats=args.hf_cb_repeats
        )
        if args.only in (None, "gen")
        else ""
    )
    sync = bench_weight_update(args.repeats, args.bucket_mb) if args.only in (None, "sync") else []
    print(markdown(gen, sync))


if __name__ == "__main__":
    main()
