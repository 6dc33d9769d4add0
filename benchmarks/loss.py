"""Loss benchmark: time and peak memory of stable_opd and lsm, vocab-parallel (megaopd.losses on
megaopd.ops) vs a naive implementation that all-gathers the full logits and takes a full log_softmax.

    python benchmarks/loss.py                          # Qwen vocab 152064, 4096 tokens per rank, TP=1 and 2
    python benchmarks/loss.py --tokens 1024 --tp 1,2   # smaller (state it when you report numbers)

Workload per rank: one micro-batch of `tokens` response tokens, student logits shard [1, tokens,
V/TP] float32 (requires grad), the reference logits shard (stable_opd), teacher sampled-token log-probs
and top-32 ids/log-probs (lsm). stable_opd = opd (PPO-clip, entropy metric) + 0.1 sft + 0.01 exact
ref-KL; its golden tokens share the micro-batch's forward (golden_logits = logits), so the SFT term
reuses the sampled-token log-probs in both implementations. The vocab-parallel stable_opd takes its
log-probs, reference KL and entropy metric from one fused op (ops.vocab_parallel_logprobs_kl, through
LossInputs); `--unfused` also times it on the separate ops (LossInputs(fuse_reference=False)). One step =
loss forward + backward to the logits shard.

Memory method: Linux per-process peak RSS. Before each step the worker resets its high-water mark
(`echo 5 > /proc/self/clear_refs`, which resets VmHWM) and reads VmRSS with every input already
allocated; after backward it reads VmHWM. peak = VmHWM - VmRSS_before: everything the loss allocates,
including the logits gradient it produces. Workers run with MALLOC_MMAP_THRESHOLD_=65536 so freed
buffers go back to the OS (a reused heap page would hide an allocation from RSS). Reported per rank as
the max over ranks. Time: median wall time of `--repeats` steps after one warm-up, ranks in lockstep
(barrier before each step), `--threads` intra-op threads per worker (default 1). Best-of-N is the
headline number because the machine is shared; the median is printed beside it.

On a GPU (`--device cuda`; one process, TP=1, bf16 by default, tokens 4096 and 8192 unless --tokens says):

    python benchmarks/loss.py --device cuda [--tokens 4096,8192] [--dtype bfloat16] [--repeats 20]
    python benchmarks/loss.py --device cuda --sweep   # the Triton fused op under each launch configuration
    python benchmarks/loss.py --sweep                 # its code on CPU, interpreted: T=2, V=1024 (a smoke run)

times the Stable-OPD loss (forward + backward to the logits) as: the naive formula (eager, every [T, V]
intermediate in float32), the same formula under torch.compile, the megaopd loss (build_loss("stable_opd")
on LossInputs: the ops' default impl, Triton on CUDA), and the fused op under each implementation
(ops.vocab_parallel_logprobs_kl with impl="torch" / "triton", plus the loss's per-token arithmetic written
here). Time: CUDA events around each step, the median of --repeats (>= 20) after 3 warm-ups; peak = the
allocator's peak above what was allocated before the step. GB/s = the bound's bytes / time, where the bound
reads the logits and the reference logits twice each and writes the gradient once (5 T V dtype-sized
passes); "of bound" = that rate / --peak-gbs (default 3000, ~an H100's HBM3 in practice).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN_VOCAB = 152064
TEACHER_K = 32


# ---------------------------------------------------------------------------------------------- naive losses
class _GatherVocab(torch.autograd.Function):
    """forward: all-gather the vocab shards into [..., V]; backward: this rank's slice of the gradient
    (every TP rank computes the same loss, megatron's convention, so no reduction is needed)."""

    @staticmethod
    def forward(ctx, shard, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.rank, ctx.v = rank, shard.shape[-1]
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.rank * ctx.v : (ctx.rank + 1) * ctx.v], None


def _full(shard, group):
    return shard if group is None or dist.get_world_size(group) == 1 else _GatherVocab.apply(shard, group)


def naive_stable_opd(d, group, sft_weight=0.1, ref_kl_weight=0.01, eps=0.2, entropy=True):
    logp_full = F.log_softmax(_full(d["logits"], group).float(), dim=-1)
    logp = logp_full.gather(-1, d["ids"][..., None])[..., 0]
    n = d["mask"].sum()
    adv = d["teacher_lp"] - d["old_lp"]
    ratio = torch.exp(logp - d["old_lp"])
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    with torch.no_grad():
        # The same metric the opd term logs.
        entropy = -(logp_full.exp() * logp_full).sum(-1) if entropy else None
        ref_lp_full = F.log_softmax(_full(d["ref_logits"], group).float(), dim=-1)
    kl = (logp_full.exp() * (logp_full - ref_lp_full)).sum(-1)
    loss = ((pg + sft_weight * -logp + ref_kl_weight * kl) * d["mask"]).sum() / n
    return loss, entropy


def naive_lsm(d, group):
    logp_full = F.log_softmax(_full(d["logits"], group).float(), dim=-1)
    p_s = logp_full.gather(-1, d["topk_ids"])
    p_hat = p_s - torch.logsumexp(p_s, -1, keepdim=True)
    q_hat = d["topk_lp"] - torch.logsumexp(d["topk_lp"], -1, keepdim=True)
    kl = (p_hat.exp() * (p_hat - q_hat)).sum(-1)
    return (kl * d["mask"]).sum() / d["mask"].sum(), kl


# ---------------------------------------------------------------------------------------------- vocab-parallel
def parallel_step(loss_fn, d, group, fuse=True):
    from megaopd.losses import LossInputs

    inputs = LossInputs(
        fuse_reference=fuse,
        logits_BTv=d["logits"],
        token_ids_BT=d["ids"],
        loss_mask_BT=d["mask"],
        tp_group=group,
        old_logprobs_BT=d["old_lp"],
        teacher_logprobs_BT=d["teacher_lp"],
        ref_logits_BTv=d["ref_logits"],
        teacher_topk_ids_BTK=d["topk_ids"],
        teacher_topk_logprobs_BTK=d["topk_lp"],
        golden_logits_BTv=d["logits"],
        golden_ids_BT=d["ids"],
        golden_mask_BT=d["mask"],
    )
    result = loss_fn(inputs)
    return result.total, result.metrics  # shaped like the naive steps' (loss, metrics)


# ---------------------------------------------------------------------------------------------- measurement
def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) / 1024


def _make_inputs(tokens, vocab, rank, world, with_ref=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = vocab // world
    # Every rank draws its own shard: the values do not matter for cost, only the shapes.
    g.manual_seed(seed * 1000 + rank)
    logits = torch.randn(1, tokens, v, generator=g) * 3
    # Only stable_opd reads the reference logits; an lsm-only run leaves them out to fit larger --tokens.
    ref_logits = logits + torch.randn(1, tokens, v, generator=g) if with_ref else None
    g.manual_seed(seed)  # per-token data identical on every TP rank
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    return dict(
        logits=logits.requires_grad_(True),
        ref_logits=ref_logits,
        ids=ids,
        mask=torch.ones(1, tokens),
        old_lp=-torch.rand(1, tokens, generator=g) * 5,
        teacher_lp=-torch.rand(1, tokens, generator=g) * 5,
        topk_ids=torch.randint(0, vocab, (1, tokens, TEACHER_K), generator=g),
        topk_lp=-torch.rand(1, tokens, TEACHER_K, generator=g).sort(-1).values * 10,
    )


def bench_worker(rank, world, tokens, vocab, repeats, losses, entropy, unfused=False):
    from megaopd.losses import build_loss

    group = dist.group.WORLD if world > 1 else None
    d = _make_inputs(tokens, vocab, rank, world, with_ref="stable_opd" in losses)
    stable_opd = build_loss("stable_opd", {"opd": {"log_entropy": entropy}})
    lsm = build_loss("lsm", {"k": TEACHER_K})
    fns = {
        ("stable_opd", "vocab_parallel"): lambda: parallel_step(stable_opd, d, group),
        ("lsm", "vocab_parallel"): lambda: parallel_step(lsm, d, group),
        ("stable_opd", "naive"): lambda: naive_stable_opd(d, group, entropy=entropy),
        ("lsm", "naive"): lambda: naive_lsm(d, group),
        # stable_opd on the separate ops (three passes, two summed gradients): the pre-fusion path.
        ("stable_opd", "unfused"): lambda: parallel_step(stable_opd, d, group, fuse=False),
    }
    times = {key: [] for key in fns}
    peaks = {key: [] for key in fns}
    for loss_name in losses:
        # The two implementations alternate step by step, so a change in the machine's load (it is
        # shared) hits both alike; the first round warms up (allocator, lazy imports).
        impls = ("vocab_parallel", "naive") + (("unfused",) if unfused and loss_name == "stable_opd" else ())
        for i in range(repeats + 1):
            for impl in impls:
                key = (loss_name, impl)
                d["logits"].grad = None
                if world > 1:
                    dist.barrier()
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets this process's peak RSS (VmHWM) to its current RSS
                before = _status_mib("VmRSS")
                t0 = time.perf_counter()
                loss, _ = fns[key]()
                loss.backward()
                elapsed = time.perf_counter() - t0
                peak = _status_mib("VmHWM") - before
                del loss, _
                if i > 0:
                    times[key].append(elapsed)
                    peaks[key].append(peak)
    return {key: (min(times[key]), statistics.median(times[key]), max(peaks[key])) for key in fns if times[key]}


# ---------------------------------------------------------------------------------------------- one GPU
def ops_stable_opd(d, impl, sft_weight=0.1, ref_kl_weight=0.01, eps=0.2):
    """stable_opd's arithmetic (as naive_stable_opd) on the fused op with an explicit implementation."""
    from megaopd import ops

    logp, kl, entropy = ops.vocab_parallel_logprobs_kl(
        d["logits"], d["ids"], d["ref_logits"], with_entropy=True, impl=impl
    )
    adv = d["teacher_lp"] - d["old_lp"]
    ratio = torch.exp(logp - d["old_lp"])
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    loss = ((pg + sft_weight * -logp + ref_kl_weight * kl) * d["mask"]).sum() / d["mask"].sum()
    return loss, entropy


def _gpu_inputs(tokens, vocab, dtype, device):
    g = torch.Generator(device=device).manual_seed(tokens)
    logits = (3 * torch.randn(1, tokens, vocab, generator=g, device=device)).to(dtype)
    ref = (logits.float() + torch.randn(1, tokens, vocab, generator=g, device=device)).to(dtype)
    return dict(
        logits=logits.requires_grad_(),
        ref_logits=ref,
        ids=torch.randint(0, vocab, (1, tokens), generator=g, device=device),
        mask=torch.ones(1, tokens, device=device),
        old_lp=-5 * torch.rand(1, tokens, generator=g, device=device),
        teacher_lp=-5 * torch.rand(1, tokens, generator=g, device=device),
        # read by parallel_step's LossInputs, unused by stable_opd
        topk_ids=torch.zeros(1, tokens, TEACHER_K, dtype=torch.long, device=device),
        topk_lp=torch.zeros(1, tokens, TEACHER_K, device=device),
    )


def _time_steps(step, d, repeats, device, backward=True):
    """(median ms, peak bytes above the allocated before) of forward + backward (forward alone with
    backward=False); CUDA events on a GPU."""
    cuda = device.type == "cuda"
    times, peak = [], 0
    for i in range(3 + repeats):
        d["logits"].grad = None
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        loss, _ = step(d)
        if backward:
            loss.backward()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        else:
            elapsed = (time.perf_counter() - t0) * 1e3
        del loss
        if i >= 3:
            times.append(elapsed)
    return statistics.median(times), peak


def gpu_main(args):
    from megaopd.losses import build_loss

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    stable_opd = build_loss("stable_opd", {"opd": {"log_entropy": True}})
    compiled = torch.compile(naive_stable_opd)
    variants = {
        "naive (eager, float32 [T, V] intermediates)": lambda d: naive_stable_opd(d, None),
        "naive under torch.compile": lambda d: compiled(d, None),
        "megaopd stable_opd (LossInputs, default impl)": lambda d: parallel_step(stable_opd, d, None),
        "fused op, impl=torch": lambda d: ops_stable_opd(d, "torch"),
        "fused op, impl=triton": lambda d: ops_stable_opd(d, "triton"),
    }
    skip = set(args.skip.split(",")) if args.skip else set()
    token_counts = [int(x) for x in (args.tokens or "4096,8192").split(",")]
    size = torch.finfo(dtype).bits // 8
    print(
        f"\n{torch.cuda.get_device_name(device) if device.type == 'cuda' else device}, torch {torch.__version__}, "
        f"vocab {args.vocab}, {args.dtype} logits, TP=1; median of {args.repeats} steps (forward + backward); "
        f"bound = 5 T V x {size} bytes (logits and reference read twice, gradient written once) at "
        f"{args.peak_gbs:.0f} GB/s\n"
    )
    print("| variant | T | ms | GB/s | of bound | bound ms | loss | peak GiB above inputs |")
    print("|---|---|---|---|---|---|---|---|")
    for T in token_counts:
        d = _gpu_inputs(T, args.vocab, dtype, device)
        bound_bytes = 5 * T * args.vocab * size
        for name, step in variants.items():
            if any(k in name for k in skip):
                continue
            loss = float(step(d)[0].detach())
            ms, peak = _time_steps(step, d, args.repeats, device)
            gbs = bound_bytes / (ms * 1e-3) / 1e9
            print(
                f"| {name} | {T} | {ms:.2f} | {gbs:.0f} | {gbs / args.peak_gbs:.2f} "
                f"| {bound_bytes / args.peak_gbs / 1e9 * 1e3:.2f} | {loss:.6f} | {peak / 2**30:.2f} |",
                flush=True,
            )
        del d
        if device.type == "cuda":
            torch.cuda.empty_cache()


def sweep_main(args):
    """The fused op (impl=triton) under each launch configuration (block, warps, stages of prefetched loads; one
    split per row, as the default launches at these T): forward (stats kernel: reads both logits, 2/5 of the
    bound's bytes, with the loss's few per-token ops) and backward (grad kernel: reads both, writes the
    gradient, 3/5) timed apart, each against its share of the bound: the table to choose
    megaopd/ops/_triton.py's launch_config from on a GPU (issue 27: the kernels at 0.47-0.61 of the bound)."""
    from megaopd.ops import _triton

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton's interpreter (a smoke run)"
    print(
        f"\n{name}, vocab {args.vocab}, {args.dtype}; fused op impl=triton, "
        f"median of {args.repeats}; the default launch first\n"
    )
    print(
        "| T | block | warps | stages | forward ms | of its bound | backward ms | of its bound | total ms "
        "| of bound | loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def forward(x):
        with torch.no_grad():
            return ops_stable_opd(x, "triton")

    def both(x):
        return ops_stable_opd(x, "triton")

    for T in [int(x) for x in (args.tokens or "4096,8192").split(",")]:
        d = _gpu_inputs(T, args.vocab, dtype, device)
        bound_ms = 5 * T * args.vocab * size / args.peak_gbs / 1e6
        default = _triton.launch_config(T, args.vocab, device)
        configs = [None] + [(b, w, st) for b in (1024, 2048, 4096) for w in (4, 8, 16) for st in (1, 2, 3)]
        for cfg in configs:
            _triton.FORCE_LAUNCH = None if cfg is None else (cfg[0], 1, cfg[1], cfg[2])
            try:
                value = float(both(d)[0].detach())
                f_ms, _ = _time_steps(forward, d, args.repeats, device, backward=False)
                ms, _ = _time_steps(both, d, args.repeats, device)
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile is a row, not the end
                print(f"| {T} | {cfg} | failed: {type(e).__name__}: {str(e)[:80]} |||||||||")
                continue
            b, w, st = (f"default {default.block}", default.warps, default.stages) if cfg is None else cfg
            b_ms = ms - f_ms  # medians of separate runs: noise can leave it <= 0
            b_of = f"{0.6 * bound_ms / b_ms:.2f}" if b_ms > 0 else "n/a"
            print(
                f"| {T} | {b} | {w} | {st} | {f_ms:.2f} | {0.4 * bound_ms / f_ms:.2f} | {b_ms:.2f} | {b_of} "
                f"| {ms:.2f} | {bound_ms / ms:.2f} | {value:.6f} |",
                flush=True,
            )
        _triton.FORCE_LAUNCH = None
        del d
        if device.type == "cuda":
            torch.cuda.empty_cache()


def count_ops_main(args):
    """Operators each variant dispatches (a TorchDispatchMode count: every aten call, views included) in one
    forward and one backward. Where the GPU finishes before the host has issued them, as for the loss at
    T=4096 on an H100 (section "GPU"), their number, not the logits' bytes, sets the time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megaopd.losses import build_loss

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    device = torch.device(args.device)
    T = int(args.tokens or 16)
    d = _gpu_inputs(T, args.vocab, torch.float32 if device.type == "cpu" else getattr(torch, args.dtype), device)
    stable_opd = build_loss("stable_opd", {"opd": {"log_entropy": True}})
    variants = {
        "fused op + the formula's per-token ops (impl default)": lambda x: ops_stable_opd(x, "auto"),
        "megaopd stable_opd loss (LossInputs)": lambda x: parallel_step(stable_opd, x, None),
    }
    print(f"\n{device}, T={T}, vocab {args.vocab}: aten operators dispatched\n")
    print("| variant | forward | backward | total |")
    print("|---|---|---|---|")
    for name, step in variants.items():
        step(d)[0].backward()  # warm-up: lazy initializations are not the step's
        d["logits"].grad = None
        with Count() as fwd:
            loss = step(d)[0]
        with Count() as bwd:
            loss.backward()
        d["logits"].grad = None
        print(f"| {name} | {fwd.n} | {bwd.n} | {fwd.n + bwd.n} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default: TP workers over gloo, the table above) or cuda (one GPU, CUDA events)",
    )
    p.add_argument("--dtype", default="bfloat16", help="logits dtype with --device cuda (default bfloat16)")
    p.add_argument("--peak-gbs", type=float, default=3000.0, help="memory bandwidth for the bound, GB/s")
    p.add_argument("--skip", default="", help="with --device cuda: comma-separated substrings of variants to skip")
    p.add_argument(
        "--tokens",
        default=None,
        help="response tokens per rank (default 4096; with --device cuda a list, default 4096,8192)",
    )
    p.add_argument("--vocab", type=int, default=QWEN_VOCAB, help="vocabulary size (default Qwen2.5: 152064)")
    p.add_argument("--tp", default="1,2", help="comma-separated TP sizes (gloo workers)")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed steps after the warm-up (default 3 on CPU, 20 with --device cuda)",
    )
    p.add_argument("--losses", default="stable_opd,lsm")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads per worker (default 1: extra threads spin against other jobs on a shared machine)",
    )
    p.add_argument(
        "--unfused",
        action="store_true",
        help="also time stable_opd on the separate (unfused) ops, LossInputs(fuse_reference=False)",
    )
    p.add_argument(
        "--no-entropy",
        action="store_true",
        help="stable_opd without the entropy metric (opd.log_entropy=false), in both implementations",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="time the Triton fused op under each launch configuration instead (on CPU: a smoke run, "
        "TRITON_INTERPRET=1)",
    )
    p.add_argument(
        "--count-ops",
        action="store_true",
        help="count the operators the loss and the fused op dispatch, forward and backward (default "
        "T=16, vocab 512 on CPU: the count does not depend on the sizes)",
    )
    args = p.parse_args(argv)
    if args.count_ops:
        args.vocab = 512 if args.vocab == QWEN_VOCAB and args.device == "cpu" else args.vocab
        return count_ops_main(args)
    if args.device == "cpu" and args.sweep:  # a smoke run of the sweep's code through Triton's interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined (first import below)
        args.tokens, args.repeats = args.tokens or "2", args.repeats or 1
        args.vocab = 1024 if args.vocab == QWEN_VOCAB else args.vocab
    if args.device != "cpu" or args.sweep:
        args.repeats = args.repeats or 20
        return sweep_main(args) if args.sweep else gpu_main(args)
    args.repeats = args.repeats or 3
    args.tokens = int(args.tokens or 4096)

    # Read by glibc at process start, so it must be in the environment the workers inherit.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    from megaopd.parallel.launch import spawn

    losses = args.losses.split(",")
    rows = []
    for tp in [int(x) for x in args.tp.split(",")]:
        if args.vocab % tp:
            raise SystemExit(f"--vocab {args.vocab} is not divisible by TP={tp}")
        threads = str(args.threads)
        per_rank = spawn(
            bench_worker,
            world_size=tp,
            timeout=3600,
            env={"MEGAOPD_WORKER_THREADS": threads},
            args=(args.tokens, args.vocab, args.repeats, losses, not args.no_entropy, args.unfused),
        )
        for loss_name in losses:
            nv = [r[(loss_name, "naive")] for r in per_rank]
            for impl, label in (("vocab_parallel", loss_name), ("unfused", f"{loss_name} (unfused ops)")):
                if (loss_name, impl) not in per_rank[0]:
                    continue
                vp = [r[(loss_name, impl)] for r in per_rank]
                # Slowest rank's best / median step; largest rank's peak.
                rows.append(
                    (
                        label,
                        tp,
                        max(x[0] for x in vp),
                        max(x[0] for x in nv),
                        max(x[1] for x in vp),
                        max(x[1] for x in nv),
                        max(x[2] for x in vp),
                        max(x[2] for x in nv),
                    )
                )
            print(f"done: {loss_name} TP={tp}", file=sys.stderr, flush=True)

    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(
        f"\nvocab {args.vocab}, {args.tokens} tokens per rank (full float32 logits {logits_mib:.0f} MiB), "
        f"entropy metric {'off' if args.no_entropy else 'on'}; time = best (median) of {args.repeats} steps, "
        f"forward + backward; peak = VmHWM - VmRSS before the step, max over ranks; VP = vocab-parallel\n"
    )
    print(
        "| loss | TP | time VP (s) | time naive (s) | time ratio VP/naive | peak VP (MiB) | peak naive (MiB) "
        "| memory ratio VP/naive | memory target |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for loss_name, tp, t_vp, t_nv, med_vp, med_nv, m_vp, m_nv in rows:
        print(
            f"| {loss_name} | {tp} | {t_vp:.2f} ({med_vp:.2f}) | {t_nv:.2f} ({med_nv:.2f}) | {t_vp / t_nv:.2f} "
            f"| {m_vp:.0f} | {m_nv:.0f} | {m_vp / m_nv:.2f} | <= {1 / tp + 0.1:.2f} |"
        )


if __name__ == "__main__":
    main()
