"""--bench: the GPU measurements (scripts/gpu_check.sh says what and why), as INFO rows.

loss    fused Stable-OPD (build_loss("stable_opd") on LossInputs, one fused pass for log-probs + reference KL)
        vs a naive full-vocabulary float32 version (log_softmax materialized), same inputs and loss, bf16
        logits, V=152064, 4096 and 8192 tokens: time (median of 3 after a warm-up) and peak memory above the
        inputs (torch.cuda.max_memory_allocated), and their ratios.
engine  the embedded engine beside transformers' generate (dynamic, static compiled) and continuous batching,
        64 rows x 128 tokens and 192 OPD-like mixed lengths through 64 slots (megaopd.gpucheck.engine_bench).
packing one training step padded vs packed (THD, varlen flash kernel) for OPD-like long-tailed lengths
        (mean about 3k, max 8k): time, peak memory, useful-token fraction, ratios.
trainer the trainer's phases at the 1.5B shape (student and teacher Qwen2.5-1.5B-shaped), tokens/s of the
        training phase and MFU = (6 N tokens + 12 L h sum_i s_i^2) / time/train / peak bf16 FLOP/s.
        Recomputation: megaopd's config has no key for it yet, so only the plain run is measured (a row says so).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from dataclasses import dataclass

import torch

from megaopd.gpucheck.build import QWEN_VOCAB, hf_config_dict, opd_lengths, write_hf_dir
from megaopd.gpucheck.report import Table
from megaopd.metrics import flops


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _naive_stable_opd(logits, ids, ref_logits, old_lp, teacher_lp, loss_mask, golden_mask, sft_w, kl_w, eps=0.2):
    """OPD (PPO-clip, advantage = teacher - old log-prob) + sft_w x SFT + kl_w x exact KL(p || ref), token-mean
    each, with every [T, V] intermediate materialized in float32."""
    logp = torch.log_softmax(logits.float(), -1)
    logq = torch.log_softmax(ref_logits.float(), -1)
    lp = logp.gather(-1, ids[..., None])[..., 0]
    kl = (logp.exp() * (logp - logq)).sum(-1)
    adv = teacher_lp - old_lp
    ratio = torch.exp(lp - old_lp)
    pg = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    n, ng = loss_mask.sum(), golden_mask.sum()
    return (pg * loss_mask).sum() / n + sft_w * (-lp * golden_mask).sum() / ng + kl_w * (kl * loss_mask).sum() / n


def _measure(fn, device, reps=3):
    """(median seconds, peak bytes allocated above what was allocated before) of fn() incl. backward."""
    fn()  # warm-up
    _sync(device)
    times, peak = [], 0
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
    return statistics.median(times), peak


def bench_loss(table: Table, device, vocab: int, token_counts, dtype=torch.bfloat16) -> None:
    from megaopd.losses import build_loss

    cfg = {"sft_weight": 0.1, "ref_kl_weight": 0.01}
    loss_fn = build_loss("stable_opd", cfg)
    dt = str(dtype).replace("torch.", "")
    for T in token_counts:
        with table.guard("bench", f"loss T={T}", dt):
            _bench_loss_at(table, loss_fn, device, vocab, T, dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # this T's tensors died with _bench_loss_at's frame


def _bench_loss_at(table: Table, loss_fn, device, vocab: int, T: int, dtype) -> None:
    """One token count: the fused loss vs the naive formula, values then time and memory."""
    from megaopd.losses import LossInputs

    dt = str(dtype).replace("torch.", "")
    g = torch.Generator(device=device).manual_seed(T)
    logits = (3 * torch.randn(1, T, vocab, device=device, generator=g)).to(dtype).requires_grad_()
    ref = (logits.detach().float() + torch.randn(1, T, vocab, device=device, generator=g)).to(dtype)
    ids = torch.randint(0, vocab, (1, T), device=device, generator=g)
    old_lp = -10 + torch.randn(1, T, device=device, generator=g)
    teacher_lp = -10 + torch.randn(1, T, device=device, generator=g)
    half = torch.arange(T, device=device)[None] < T // 2  # first half on-policy, second half golden
    loss_mask, golden_mask = half.float(), (~half).float()

    def fused():
        logits.grad = None
        inputs = LossInputs(
            logits_BTv=logits,
            token_ids_BT=ids,
            loss_mask_BT=loss_mask,
            old_logprobs_BT=old_lp,
            teacher_logprobs_BT=teacher_lp,
            ref_logits_BTv=ref,
            golden_logits_BTv=logits,
            golden_ids_BT=ids,
            golden_mask_BT=golden_mask,
        )
        loss = loss_fn(inputs).total
        loss.backward()
        return loss

    def naive():
        logits.grad = None
        loss = _naive_stable_opd(logits, ids, ref, old_lp, teacher_lp, loss_mask, golden_mask, 0.1, 0.01)
        loss.backward()
        return loss

    lf, ln = float(fused().detach()), float(naive().detach())
    table.le(
        "bench",
        f"fused vs naive Stable-OPD loss T={T} V={vocab}",
        dt,
        "loss rel diff",
        abs(lf - ln) / max(abs(ln), 1e-6),
        1e-3,
    )
    (tf, mf), (tn, mn) = _measure(fused, device), _measure(naive, device)
    table.info("bench", f"fused Stable-OPD loss T={T} V={vocab}", dt, "fwd+bwd ms", tf * 1e3)
    table.info("bench", f"naive Stable-OPD loss T={T} V={vocab}", dt, "fwd+bwd ms", tn * 1e3)
    table.info("bench", f"time naive / fused T={T}", dt, "ratio", tn / tf)
    if device.type == "cuda":
        table.info("bench", f"fused Stable-OPD loss T={T} V={vocab}", dt, "peak GiB above inputs", mf / 2**30)
        table.info("bench", f"naive Stable-OPD loss T={T} V={vocab}", dt, "peak GiB above inputs", mn / 2**30)
        table.info("bench", f"memory naive / fused T={T}", dt, "ratio", mn / max(mf, 1))


def bench_engine(
    table: Table,
    hf_dir: str,
    dtypes,
    slots: int = 64,
    new_tokens: int = 128,
    prompt_len: int = 32,
    repeats: int = 3,
    generators=None,
    profile: bool = False,
) -> None:
    """megaopd.gpucheck.engine_bench (the table of benchmarks/rollout.py): the engine beside transformers'
    generate (dynamic; static cache, compiled on CUDA) and its continuous batching, fixed and mixed lengths;
    printed as markdown and kept as INFO rows, with the engine's share of the weight-read bound."""
    from megaopd.gpucheck import engine_bench as eb

    rates = {}
    for dtype in dtypes:
        with table.guard("bench", "embedded engine", dtype):
            gens = eb.Generators(
                hf_dir,
                "cuda" if torch.cuda.is_available() else "cpu",
                dtype,
                slots,
                generators or eb.DEFAULT_GENERATORS,
            )
            vocab = int(gens.engine.vocab_size)
            case_list = eb.cases(slots, prompt_len, new_tokens, vocab)

            def log(line, dtype=dtype):
                print(f"[gpu_check] engine {dtype}: {line}", flush=True)

            eb.measure(gens, case_list, repeats, log=log)
            print(
                f"[gpu_check] engine bench, {os.path.basename(hf_dir)}, {dtype}:\n"
                + eb.markdown(case_list, gens.errors),
                flush=True,
            )
            if profile:
                for c in case_list:
                    eb.profile(gens, c, log=log)
            for c in case_list:
                for name, times in c.seconds.items():
                    rate = c.tokens / statistics.median(times)
                    rates[dtype, c.name, name] = rate
                    table.info(
                        "bench",
                        f"{name} {c.name} {len(c.prompts)} rows / {slots} slots x {new_tokens} new",
                        dtype,
                        "generated tokens/s",
                        rate,
                    )
            if ("fixed", "hf static") in [(k[1], k[2]) for k in rates if k[0] == dtype]:
                table.info(
                    "bench",
                    "engine / hf static (compiled) generate, fixed",
                    dtype,
                    "ratio",
                    rates[dtype, "fixed", "engine"] / rates[dtype, "fixed", "hf static"],
                )
            table.info(
                "bench",
                "engine mixed / fixed lengths",
                dtype,
                "ratio",
                rates[dtype, "mixed", "engine"] / rates[dtype, "fixed", "engine"],
            )
            for case in ("fixed", "mixed"):
                if (dtype, case, "engine compiled") in rates:
                    table.info(
                        "bench",
                        f"engine compiled / engine, {case}",
                        dtype,
                        "ratio",
                        rates[dtype, case, "engine compiled"] / rates[dtype, case, "engine"],
                    )
            if torch.cuda.is_available():
                weight_bytes = sum(p.numel() * p.element_size() for p in gens.engine.model.parameters())
                bound = slots * 3.0e12 / weight_bytes  # every step reads every weight once, ~3 TB/s (H100 HBM3)
                table.info(
                    "bench",
                    f"engine fixed / weight-read bound ({bound:.0f} tokens/s)",
                    dtype,
                    "fraction",
                    rates[dtype, "fixed", "engine"] / bound,
                )
            del gens
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if ("bfloat16", "fixed", "engine") in rates and ("float32", "fixed", "engine") in rates:
        table.info(
            "bench",
            "engine bf16 / float32, fixed",
            "-",
            "ratio",
            rates["bfloat16", "fixed", "engine"] / rates["float32", "fixed", "engine"],
        )


def bench_trainer(
    table: Table,
    workdir: str,
    device: str,
    shape: str = "qwen2.5-1.5b",
    steps: int = 4,
    overrides: list[str] | None = None,
    peak_tflops: float | None = None,
    timeout_s: float = 480,
    label: str = "",
) -> None:
    """The trainer at `shape` (student = reference = teacher shape), phases and MFU from RUN/metrics.jsonl,
    and `megaopd plan`'s predicted peak beside the measured one."""
    from megaopd.gpucheck.trainer_check import YAML, GpuMemoryPoll, read_metrics, run_trainer, train_command

    dt = "bfloat16"
    name = f"{shape} {label}".strip()
    with table.guard("bench", f"trainer {name}", dt):
        model_dir = write_hf_dir(os.path.join(workdir, f"bench_{shape}"), shape, QWEN_VOCAB, device, torch.bfloat16, 4)
        run_dir = os.path.join(workdir, "run_bench")
        shutil.rmtree(run_dir, ignore_errors=True)
        prompts, samples, new = 16, 4, 256
        args = [
            f"run.dir={run_dir}",
            f"student.path={model_dir}",
            f"teacher.path={model_dir}",
            f"trainer.max_steps={steps}",
            f"trainer.save_interval={steps + 100}",
            f"trainer.prompts_per_step={prompts}",
            f"trainer.samples_per_prompt={samples}",
            f"rollout.max_new_tokens={new}",
            f"logging.samples_per_step={prompts * samples}",
            # auto: the engine in the student's bf16, as a job gets it (part c's YAML pins float32 for its bounds)
            "rollout.parity_interval=0",
            "rollout.engine_dtype=auto",
            *(overrides or []),
        ]
        cmd = train_command(YAML, args)
        with GpuMemoryPoll() as mem:
            log_path = os.path.join(workdir, f"train_bench_{label or 'plain'}.log".replace("=", "_"))
            rc, _ = run_trainer(cmd, log_path, timeout_s)
        table.eq("bench", f"trainer {name} {steps} steps", dt, "exit code", rc, 0)
        if rc != 0:  # the log stays on the device machine: its end is what says why
            with open(log_path) as f:
                print(
                    f"[gpu_check] trainer {name} failed; the end of {log_path}:\n" + "".join(f.readlines()[-40:]),
                    flush=True,
                )
        records = read_metrics(run_dir)[1:]  # the first step pays for warm-up
        if not records:
            return
        for key in ("time/step", "time/rollout", "time/actor_logprobs", "time/teacher", "time/train", "time/sync"):
            vals = [r[key] for r in records if r.get(key) is not None]
            if vals:
                table.info("bench", f"trainer {name}: mean {key}", dt, "s", sum(vals) / len(vals))
        if mem.peak_mib is not None:
            table.info("bench", f"trainer {name}: peak GPU memory (nvidia-smi)", dt, "GiB", mem.peak_mib / 1024)
        predicted = _planned_peak_gib(YAML, args)
        if predicted is not None:
            table.info(
                "bench",
                f"trainer {name}: megaopd plan's peak (CUDA context, allocator reserve, engine "
                f"included; no flat margin)",
                dt,
                "GiB",
                predicted,
            )
        if predicted is not None and mem.peak_mib is not None:  # the plan's contract: within 15% on every trainer bench
            table.info(
                "bench", f"trainer {name}: planned / measured peak", dt, "ratio", predicted / (mem.peak_mib / 1024)
            )
        # Tokens of the training phase: every sequence's prompt + response (the model runs on all of them).
        n_seq = prompts * samples
        resp = [r.get("rollout/response_length_mean") for r in records]
        prompt_len = _prompt_len_mean(run_dir, model_dir)
        if None in resp or prompt_len is None:
            table.info("bench", f"trainer {name}: tokens/s, MFU", dt, "n/a", "response or prompt lengths not logged")
            return
        t_train = [r["time/train"] for r in records]
        tokens = [n_seq * (prompt_len + x) for x in resp]
        table.info("bench", f"trainer {name}: training tokens/s", dt, "tokens/s", sum(tokens) / sum(t_train))
        # MFU as the trainer logs it (megaopd.metrics.flops): model FLOPs (6N per trained token + attention) and
        # hardware FLOPs (+ recomputation, the lockstep reference, the fused output layer's recompute).
        # peak_tflops (--peak-tflops) rescales the trainer's MFU from its table's peak to the one given.
        known = flops.peak_tflops(torch.cuda.get_device_name() if torch.cuda.is_available() else None)
        scale = known / peak_tflops if peak_tflops and known else 1.0
        for key in (
            "perf/mfu_model_train",
            "perf/mfu_hardware_train",
            "perf/mfu_model_step",
            "perf/model_train_tflops_per_gpu",
        ):
            vals = [r[key] for r in records if r.get(key) is not None]
            if vals:
                value = sum(vals) / len(vals) * (scale if "mfu" in key else 1.0)
                table.info("bench", f"trainer {name}: mean {key}", dt, key.split("/")[1], value)


def _planned_peak_gib(yaml_path: str, overrides: list[str]) -> float | None:
    """`megaopd plan`'s per-GPU peak for the run the bench starts, in GiB, as nvidia-smi shows memory: every
    item, the CUDA context and the allocator's reserve, without the flat safety margin (plan.reserved_gb=0)
    (None if it cannot be planned)."""
    from megaopd.config import load_config
    from megaopd.config.plan import plan_for
    from megaopd.config.schema import MegaOPDConfig

    try:
        gpu = (
            [f"plan.gpu_memory_gb={torch.cuda.get_device_properties(0).total_memory / 1e9:.1f}"]
            if torch.cuda.is_available()
            else []
        )
        plan = plan_for(load_config(MegaOPDConfig, yaml_path, overrides + ["plan.reserved_gb=0"] + gpu))
    except Exception as e:  # the measurement still stands without the prediction
        print(f"[gpu_check] plan failed: {type(e).__name__}: {e}", flush=True)
        return None
    return max(plan.total(p) for p in plan.phases) / 2**30


def _prompt_len_mean(run_dir: str, model_dir: str) -> float | None:
    """Mean prompt length in tokens, from the prompts the run logged (RUN/samples/step_N.jsonl)."""
    import json

    from megaopd.models.hf_io import load_tokenizer

    folder = os.path.join(run_dir, "samples")
    if not os.path.isdir(folder):
        return None
    tok = load_tokenizer(model_dir)
    lens = []
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                lens.append(len(tok(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"]))
    return sum(lens) / len(lens) if lens else None


@dataclass
class _NllMicroBatch:
    """A micro-batch of the packing bench: ids, the targets that count, the packed layout (None = padded)."""

    tokens_BS: torch.Tensor
    loss_mask_BT: torch.Tensor
    packed: object = None

    def to(self, device) -> "_NllMicroBatch":
        return _NllMicroBatch(self.tokens_BS.to(device), self.loss_mask_BT.to(device), self.packed)


def bench_packing(
    table: Table,
    device,
    shape: str,
    vocab: int,
    sequences: int = 16,
    scale: float = 1.0,
    micro_batch_size: int = 1,
    dtype=torch.bfloat16,
    reps: int = 3,
) -> None:
    """One training step (forward + backward, token-mean NLL) of a random `shape` model through the
    PipelineRunner, padded (rows padded to the longest, micro_batch_size rows per micro-batch) vs packed
    (THD rows of at most the longest sequence's tokens; the varlen flash kernel on CUDA): time, peak memory,
    useful-token fraction, and the ratios."""
    from megaopd import ops
    from megaopd.batching.packing import PackedRow, Segment, pack_by_budget
    from megaopd.models.builder import BuildOptions, build_gpt_model
    from megaopd.models.hf_config import read_hf_config
    from megaopd.parallel.dist import init_distributed
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.scoring.runner import PipelineRunner

    init_distributed()
    pgs = initialize_actor_layout(Layout(1, 1))
    cfg = read_hf_config(hf_config_dict(shape, vocab))
    model = build_gpt_model(cfg, Layout(), pgs, BuildOptions(dtype=dtype))
    prompts, responses = opd_lengths(sequences, scale)
    lengths = [p + r for p, r in zip(prompts, responses)]
    B, S = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(1)
    tokens = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S - 1)
    for b, n in enumerate(lengths):
        tokens[b, :n] = torch.randint(1, vocab, (n,), generator=g)
        mask[b, : n - 1] = 1
    n_targets = float(mask.sum())
    padded = [
        _NllMicroBatch(tokens_BS=tokens[i : i + micro_batch_size], loss_mask_BT=mask[i : i + micro_batch_size])
        for i in range(0, B, micro_batch_size)
    ]
    packed = []
    for rows in pack_by_budget(lengths, S):
        row = PackedRow([Segment(0, i, lengths[i]) for i in rows])
        packed.append(
            _NllMicroBatch(tokens_BS=row.tokens({0: tokens}, 0), loss_mask_BT=row.per_token(mask), packed=row)
        )
    runner = PipelineRunner(model, pgs, cfg.vocab_size)

    def step_fn(mb, logits, _partner):
        lp = ops.vocab_parallel_logprobs(logits[:, :-1].float(), mb.tokens_BS[:, 1:], pgs.tp)
        return -(lp * mb.loss_mask_BT).sum() / n_targets, None

    label = f"{shape} {str(dtype).split('.')[-1]}, {B} seqs, lengths mean {sum(lengths) / B:.0f} max {S}"
    results = {}
    for mode, micro in (("padded", padded), ("packed", packed)):

        def step(micro=micro):
            model.zero_grad(set_to_none=True)
            runner.run(micro, step_fn, forward_only=False)

        with table.guard("bench", f"packing {mode} {label}"):
            t, peak = _measure(step, device, reps)
            useful = sum(lengths) / sum(mb.tokens_BS.numel() for mb in micro)
            results[mode] = (t, peak)
            table.info("bench", f"packing {mode} {label}", "", "step time (s)", t)
            table.info("bench", f"packing {mode} {label}", "", "peak memory above model (GiB)", peak / 2**30)
            table.info("bench", f"packing {mode} {label}", "", "useful-token fraction", useful)
            table.info("bench", f"packing {mode} {label}", "", "micro-batches", len(micro))
            table.info("bench", f"packing {mode} {label}", "", "tokens/s (real)", sum(lengths) / t)
    if len(results) == 2:
        table.info(
            "bench", f"packing {label}", "", "step time padded / packed", results["padded"][0] / results["packed"][0]
        )
        table.info(
            "bench",
            f"packing {label}",
            "",
            "peak memory padded / packed",
            results["padded"][1] / max(results["packed"][1], 1),
        )
