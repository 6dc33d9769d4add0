"""Generation throughput: the embedded engine beside transformers' own generators, same model, same prompts.

benchmarks/rollout.py runs it on CPU (a small Qwen2) and `python -m megaopd.gpucheck --bench engine` on a
GPU (the Qwen2.5-1.5B shape); both print the table of `markdown`.

Generators (every one samples at T=1 with no filtering, ignores EOS, and makes each row's budget):
    engine      megaopd's embedded engine (megaopd.engine: slot KV cache, continuous batching, CUDA graphs
                on GPU), all rows in one run through `slots` slots
    engine compiled  the same with compile_decode (the decode step through torch.compile, then captured)
    hf dynamic  transformers' `generate` with its DynamicCache, the rows in batches of `slots` (left-padded;
                a batch runs to its longest budget, longer rows' surplus tokens are not counted)
    hf static   the same with cache_implementation="static" (transformers compiles its forward on CUDA)
    hf cb       transformers' continuous batching (init_continuous_batching: paged cache, per-request budget)

Cases: "fixed" (every row the same budget) and "mixed" (3 x slots rows, budgets from the OPD-like length
distribution of the packing benchmark, scaled to the same mean budget). Runs are interleaved (each repeat
times every generator once) so load changes hit all alike; the table gives medians and each generator's
ratio to `hf dynamic`, and the engine's mixed / fixed ratio.
"""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import dataclass, field

import torch

GENERATORS = ("engine", "engine compiled", "hf dynamic", "hf static", "hf cb")
DEFAULT_GENERATORS = ("engine", "hf dynamic", "hf static", "hf cb")
"""What runs when none are named: compiling costs a minute or more of CPU for a tiny model."""
CONTEXT_LENGTH = 1024
"""The engines' KV cache positions per slot (EmbeddedEngineConfig.context_length, as the trainer sets it):
room for every case's rows, and two engines (compiled or not) side by side on one GPU."""


@dataclass
class Case:
    name: str
    prompts: list[list[int]]
    budgets: list[int]
    seconds: dict[str, list[float]] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(self.budgets)


def cases(slots: int, prompt_len: int, new_tokens: int, vocab: int, seed: int = 0) -> list[Case]:
    """fixed: `slots` rows x new_tokens; mixed: 3 x slots rows with OPD-like budgets of mean new_tokens."""
    from megaopd.gpucheck.build import opd_lengths

    g = torch.Generator().manual_seed(seed)
    _, resp = opd_lengths(3 * slots, 1.0, seed=seed)
    mean = statistics.mean(resp)
    mixed_budgets = [max(1, round(r * new_tokens / mean)) for r in resp]
    prompts = torch.randint(3, vocab, (3 * slots, prompt_len), generator=g).tolist()
    return [Case("fixed", prompts[:slots], [new_tokens] * slots), Case("mixed", prompts, mixed_budgets)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Generators:
    """The four generators over one HF directory; `time(name, case)` runs one and returns seconds."""

    def __init__(self, hf_dir: str, device: str, dtype: str, slots: int, which=DEFAULT_GENERATORS):
        from transformers import AutoModelForCausalLM

        from megaopd.engine.config import DTYPES, EmbeddedEngineConfig
        from megaopd.engine.runner import ModelRunner

        unknown = set(which) - set(GENERATORS)
        if unknown:
            raise ValueError(f"unknown generators {sorted(unknown)}; choose among {list(GENERATORS)}")
        self.device, self.slots, self.which = torch.device(device), slots, list(which)

        def runner(**kw):
            return ModelRunner(
                EmbeddedEngineConfig(
                    hf_dir=hf_dir,
                    device=device,
                    dtype=dtype,
                    max_batch_size=slots,
                    context_length=CONTEXT_LENGTH,
                    load_tokenizer=False,
                    **kw,
                )
            )

        self.engine = runner()
        self.engine_compiled = runner(compile_decode=True) if "engine compiled" in self.which else None
        self.hf = None
        if any(w.startswith("hf") for w in self.which):
            self.hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=DTYPES[dtype]).to(self.device).eval()
        self.errors: dict[str, str] = {}

    @torch.inference_mode()
    def time(self, name: str, case: Case) -> float:
        _sync(self.device)
        t = time.perf_counter()
        made = getattr(self, "_" + name.replace(" ", "_"))(case)
        _sync(self.device)
        dt = time.perf_counter() - t
        if made != case.tokens:
            raise AssertionError(f"{name} made {made} tokens on case {case.name}, expected {case.tokens}")
        return dt

    def _engine(self, case: Case, engine=None) -> int:
        from megaopd.engine.rows import RowRequest

        rows = [
            RowRequest(prompt_ids=p, max_new_tokens=b, temperature=1.0, seed=i)
            for i, (p, b) in enumerate(zip(case.prompts, case.budgets))
        ]
        return sum(len(r.output_ids) for r in (engine or self.engine).run(rows))

    def _engine_compiled(self, case: Case) -> int:
        return self._engine(case, self.engine_compiled)

    def _hf_generate(self, case: Case, **kw) -> int:
        made = 0
        for s in range(0, len(case.prompts), self.slots):
            prompts, budgets = case.prompts[s : s + self.slots], case.budgets[s : s + self.slots]
            L = max(len(p) for p in prompts)
            ids = torch.zeros((len(prompts), L), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(prompts):
                ids[i, L - len(p) :], mask[i, L - len(p) :] = torch.tensor(p), 1
            out = self.hf.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max(budgets),
                min_new_tokens=max(budgets),
                pad_token_id=0,
                **kw,
            )
            made += sum(min(b, out.shape[1] - L) for b in budgets)
        return made

    def _hf_dynamic(self, case: Case) -> int:
        return self._hf_generate(case)

    def _hf_static(self, case: Case) -> int:
        return self._hf_generate(case, cache_implementation="static")

    def _hf_cb(self, case: Case) -> int:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        gc = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max(case.budgets),
            eos_token_id=-1,
            pad_token_id=0,
        )
        page, prompt = 256, max(len(p) for p in case.prompts)
        # transformers renamed block_size to page_size (5.17 has only block_size; 5.24 both).
        page_key = (
            "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
        )
        manager = self.hf.init_continuous_batching(
            generation_config=gc,
            continuous_batching_config=ContinuousBatchingConfig(
                max_requests_per_batch=self.slots,
                **{page_key: page},
                max_batch_tokens=max(512, self.slots * prompt),
                # Sized to the slots (left to itself it takes a share of the device's memory: all of a CPU's).
                num_blocks=self.slots * (-(-(prompt + max(case.budgets)) // page) + 1),
            ),
        )
        manager.start()
        try:
            ids = [manager.add_request(input_ids=p, max_new_tokens=b) for p, b in zip(case.prompts, case.budgets)]
            made = 0
            for rid in ids:
                for res in manager.request_id_iter(rid):
                    if res.is_finished():
                        made += len(res.generated_tokens)
        finally:
            manager.stop(block=True)
        return made


def skips(gens: Generators, name: str, case: Case) -> bool:
    """hf static is compiled on CUDA for one max_new_tokens: the mixed case's chunks (each its own longest
    budget) would each compile again, minutes of a GPU's time for a number the fixed case already gives."""
    return name == "hf static" and case.name == "mixed" and gens.device.type == "cuda"


def measure(gens: Generators, case_list: list[Case], repeats: int, log=print) -> None:
    """Interleaved: every repeat times each generator on each case once (after one warm-up run each)."""
    for case in case_list:
        for name in list(gens.which):
            if skips(gens, name, case):
                continue
            try:
                dt = gens.time(name, case)  # warm-up (and compilation / capture)
                log(f"warm-up {case.name:5s} {name:10s} {dt:7.1f} s")
            except Exception as e:  # noqa: BLE001 - a generator that fails here is reported, not fatal
                gens.errors[name] = f"{type(e).__name__}: {str(e)[:120]}"
                gens.which.remove(name)
                log(f"{name}: {gens.errors[name]}")
    for r in range(repeats):
        for case in case_list:
            for name in gens.which:
                if skips(gens, name, case):
                    continue
                dt = gens.time(name, case)
                case.seconds.setdefault(name, []).append(dt)
                log(f"repeat {r} {case.name:5s} {name:10s} {case.tokens / dt:9.1f} tok/s")


def markdown(case_list: list[Case], errors: dict[str, str] | None = None) -> str:
    lines = [
        "| case | rows | tokens | generator | median s | tokens/s | / hf dynamic |",
        "|---|---|---|---|---|---|---|",
    ]
    rate: dict[tuple[str, str], float] = {}
    for c in case_list:
        for name, times in c.seconds.items():
            rate[c.name, name] = c.tokens / statistics.median(times)
        for name, times in c.seconds.items():
            base = rate.get((c.name, "hf dynamic"))
            ratio = f"{rate[c.name, name] / base:.2f}" if base else "-"
            lines.append(
                f"| {c.name} | {len(c.prompts)} | {c.tokens} | {name} | {statistics.median(times):.3f} | "
                f"{rate[c.name, name]:.0f} | {ratio} |"
            )
    if ("fixed", "engine") in rate and ("mixed", "engine") in rate:
        lines.append("")
        lines.append(f"engine mixed / fixed tokens/s: {rate['mixed', 'engine'] / rate['fixed', 'engine']:.2f}")
    for name, err in (errors or {}).items():
        lines.append(f"{name}: not measured ({err})")
    return "\n".join(lines)


def profile(gens: Generators, case: Case, log=print, rows: int = 25) -> None:
    """One engine run of `case` under torch.profiler (CPU and, on a GPU, CUDA activity): the decode's named
    phases (engine.prefill / sample / decode_step / harvest) and the top ops by self CPU and self device time,
    so that a device call shows where the engine's time goes, not only how much there is."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gens.device.type == "cuda" else [])
    gens.time("engine", case)  # warm: captures and allocations happen outside the profile
    t = time.perf_counter()
    with torch_profile(activities=acts) as prof:
        gens.time("engine", case)
    log(f"profile {case.name}: {time.perf_counter() - t:.2f} s wall under the profiler, {case.tokens} tokens")
    averages = prof.key_averages()
    phases = [e for e in averages if e.key.startswith("engine.")]
    for e in sorted(phases, key=lambda e: e.key):
        log(
            f"  {e.key:20s} calls {e.count:6d}  CPU total {e.cpu_time_total / 1e3:9.1f} ms  "
            f"device total {getattr(e, 'device_time_total', 0.0) / 1e3:9.1f} ms"
        )
    keys = ["self_cpu_time_total"] + (["self_device_time_total"] if gens.device.type == "cuda" else [])
    for key in keys:
        log(f"top ops by {key}:\n" + averages.table(sort_by=key, row_limit=rows, max_name_column_width=60))
