"""`megaopd plan` against the measured peak memory of the same run on CPU: the tiny demo and SmolLM2-135M.

    python benchmarks/plan_vs_measured.py                          # every case (the SmolLM2 ones need the models)
    python benchmarks/plan_vs_measured.py --cases tiny_w2 --steps 3
    python benchmarks/plan_vs_measured.py --models ~/.cache/megaopd/models --cases smollm2_w1,smollm2_w2

What is measured: the peak resident set size of each rank process over the whole run (Linux VmHWM of the
process `megaopd train` spawns for that rank: start-up, model loading, every step, the final checkpoint),
read from /proc/PID/status every 0.1 s while it runs (VmHWM only grows, so the last reading is the peak up to
then). Resident means what the process has in RAM: shared library pages it touched count in full in every
rank (RSS, not PSS). The table gives the largest rank's peak (rank 0, which also runs the embedded engine)
and every rank's. The plan's number is `megaopd plan`'s per-rank peak for the same config and overrides
(plan.device=cpu: no CUDA context, allocator reserve or NCCL margin; the process baseline instead), rank 0's.

Cases (each a fresh `megaopd train` run, one at a time):
    tiny_w2      examples/tiny/stable_opd.yaml as shipped (world 2, student TP=2, 32 prompts x 4, 128 new
                 tokens, validation of 200 problems), --steps steps
    tiny_lora_w2 examples/tiny/lora_opd.yaml as shipped (the same with rank-16 adapters on every linear, the
                 reference read from the student with its adapters off, adapter syncs), --steps steps
    smollm2_w1   Stable-OPD, student = SmolLM2-135M-Instruct without layers 16-19 (26 layers), teacher = the
                 full model (30 layers), float32, world 1, --prompts prompts (2) x 2 samples, 96 new tokens, the 8
    smollm2_w2   arithmetic problems of tests/real/data with the SmolLM2 chat template (prompts 67-73 tokens,
                 goldens 25-28 with <|im_end|>: budgets data.max_prompt_len 80, data.max_golden_len 32, as a
                 user sizes them to the data); world 2 = DP 2
--models DIR holds SmolLM2-135M-Instruct (float32 HF folder) and SmolLM2-135M-Instruct-drop16-19 (the same
without layers 16-19); both are made by the real-model tier (tests/real/reference.py, scripts/install_smollm2.sh).
--parts: instead of whole runs, the items a CPU run measures exactly (PARTS: rank 0's parameters, gradient
buffers, Adam state, the embedded engine's kept base of a LoRA student's adapted weights), for tiny_w2 and
tiny_lora_w2 (tests/config/test_lora_plan.py asserts the LoRA case within 15%).
Results: benchmarks/README.md, "Plan vs measured (issue 44 item 5)" and "... a LoRA student (issue 55)".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_MODELS = os.path.expanduser("~/.cache/megaopd/models")
FULL, PRUNED = "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct-drop16-19"


@dataclass(frozen=True)
class Case:
    name: str
    config: str
    """A YAML path, or "" for the SmolLM2 config this script writes."""
    overrides: tuple[str, ...]
    world: int


def smollm2_yaml(models: str, world: int, folder: str, prompts: int = 2) -> str:
    """The SmolLM2 case's config (a file: validation.path cannot be emptied from the command line)."""
    import yaml

    cfg = {
        "run": {"world_size": world},
        "student": {"path": os.path.join(models, PRUNED), "tp": 1},
        "reference": {"tp": 1},
        "teacher": {"path": os.path.join(models, FULL), "tp": 1},
        "trainer": {"prompts_per_step": prompts, "samples_per_prompt": 2, "eval_interval": 0, "seed": 1234},
        "optimizer": {"lr": 1.0e-5, "warmup_steps": 0, "clip_grad": 1.0},
        "rollout": {"temperature": 1.0, "max_new_tokens": 96, "max_batch_size": 16},
        "data": {
            "sources": [{"path": os.path.join(ROOT, "tests/real/data/arithmetic.jsonl")}],
            "max_prompt_len": 80,
            "max_golden_len": 32,
        },
        "loss": {"name": "stable_opd", "config": {"sft_weight": 0.1, "ref_kl_weight": 0.01}},
        "logging": {"samples_per_step": 0, "tensorboard": False, "progress_bar": "off"},
    }
    path = os.path.join(folder, f"smollm2_w{world}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def cases(models: str, folder: str, prompts: int = 2) -> dict[str, Case]:
    out = {
        "tiny_w2": Case("tiny_w2", os.path.join(ROOT, "examples/tiny/stable_opd.yaml"), (), 2),
        "tiny_lora_w2": Case("tiny_lora_w2", os.path.join(ROOT, "examples/tiny/lora_opd.yaml"), (), 2),
    }
    if os.path.isdir(os.path.join(models, FULL)) and os.path.isdir(os.path.join(models, PRUNED)):
        for w in (1, 2):
            out[f"smollm2_w{w}"] = Case(f"smollm2_w{w}", smollm2_yaml(models, w, folder, prompts), (), w)
    return out


def _status_kib(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _rank_processes(launcher, world: int) -> list:
    """The rank processes of a `megaopd train` launcher, in start order: at world 1 the launcher itself (a
    single rank runs in that process, megaopd.parallel.launch.run_on_ranks); otherwise the workers it spawned
    (multiprocessing spawn_main, its direct children; not the resource tracker, nor a rank's own helpers)."""
    import psutil

    if world == 1:
        return [launcher]
    procs = []
    for p in launcher.children(recursive=False):
        try:
            cmd = " ".join(p.cmdline())
            if "spawn_main" in cmd and "resource_tracker" not in cmd:
                procs.append(p)
        except psutil.Error:
            continue
    return sorted(procs, key=lambda p: (p.create_time(), p.pid))


def measure(config: str, overrides: list[str], run_dir: str, world: int, timeout: float = 3600) -> dict:
    """Runs `megaopd train` and returns {"peaks_gb": [per rank peak RSS, rank order], "tree_peak_gb": the
    kernel's peak RSS of the largest process of the run (wait4's ru_maxrss: exact, a check on the polled
    per-rank peaks), "seconds": wall, "rc": exit status, "log": its output's tail, "timeline": [(seconds,
    [each rank's RSS GB], the log lines that appeared since the last reading)] (where the peak happened)}."""
    import psutil

    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "megaopd.cli", "train", config, f"run.dir={run_dir}", *overrides]
    log_path = os.path.join(run_dir + ".log")
    start = time.time()
    peak_kib: dict[int, int] = {}
    order: list[int] = []
    timeline: list[tuple] = []
    with open(log_path, "w") as log, open(log_path) as reader:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        launcher = psutil.Process(proc.pid)
        status = None
        while status is None:
            if time.time() - start > timeout:
                proc.kill()
            try:
                ranks = _rank_processes(launcher, world)
            except psutil.Error:
                ranks = []
            rss = []
            for p in ranks:
                hwm = _status_kib(p.pid, "VmHWM")
                if hwm is not None:
                    if p.pid not in peak_kib:
                        order.append(p.pid)
                    peak_kib[p.pid] = max(hwm, peak_kib.get(p.pid, 0))
                    rss.append((_status_kib(p.pid, "VmRSS") or 0) * 1024 / 1e9)
            timeline.append((round(time.time() - start, 1), rss, [ln[:120] for ln in reader.read().splitlines()]))
            # wait4, not Popen.wait: its rusage is the launcher's and every waited-for descendant's peak RSS.
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            status = None if pid == 0 else status
            if status is None:
                time.sleep(0.1)
    rc = os.waitstatus_to_exitcode(status)
    with open(log_path) as f:
        tail = f.read()[-3000:]
    return {
        "peaks_gb": [peak_kib[p] * 1024 / 1e9 for p in order],
        "tree_peak_gb": usage.ru_maxrss * 1024 / 1e9,
        "seconds": time.time() - start,
        "rc": rc,
        "log": tail,
        "timeline": timeline,
    }


# ------------------------------------------------------------------- the plan's parts, measured one by one
PARTS = ("student weights", "student gradients", "Adam states", "embedded engine's kept base")
"""The plan's items a CPU run can measure exactly, by name prefix (parts() and planned_parts())."""


def _parts_worker(rank, world, config, overrides, seed=1):
    """The student as the trainer builds it for `config` (roles.load_role_model, wrap_for_training, the job's
    optimizer: megatron's plain Adam on CPU), after one optimizer step, and on rank 0 the embedded engine after
    two syncs (the second of a LoRA student's adapter syncs sends the adapters alone): the bytes of this rank's
    parameters, DDP's gradient buffers, Adam's state tensors (m and v; the 0-d step counters left out) and
    the base copies the engine keeps to merge adapters into (megaopd.engine.lora.AdapterMerge)."""
    import torch

    from megaopd import ops
    from megaopd.batching.micro_batches import ScoringMicroBatch
    from megaopd.config import load_config
    from megaopd.config.schema import MegaOPDConfig
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.scoring.runner import PipelineRunner
    from megaopd.sync import WeightSync
    from megaopd.trainer.optim import build_optimizer, wrap_for_training
    from megaopd.trainer.roles import load_role_model

    cfg = load_config(MegaOPDConfig, config, list(overrides))
    pgs = initialize_actor_layout(Layout(cfg.student.tp, cfg.student.pp))
    role = load_role_model(cfg.student, pgs, trainable=True, seed=seed)
    model = role.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ddp = wrap_for_training(model, pgs, use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer)
    optimizer, _ = build_optimizer(ddp, cfg.optimizer, max_steps=2)
    ids = torch.randint(0, role.hf.vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed))
    runner = PipelineRunner(ddp, pgs, role.hf.vocab_size)

    def step_fn(mb, shard, _partner):
        lp = ops.vocab_parallel_logprobs(shard[:, :-1], mb.tokens_BS[:, 1:], pgs.tp)
        return -lp.sum() / lp.numel(), None

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    runner.run([ScoringMicroBatch(ids)], step_fn, forward_only=False)
    optimizer.step()
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in [*ddp.buffers, *ddp.expert_parallel_buffers])
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    adam = sum(
        t.numel() * t.element_size()
        for o in inner
        for state in o.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    engine = None
    if rank == 0:
        engine = EmbeddedEngine(
            EmbeddedEngineConfig(
                hf_dir=cfg.student.path, max_batch_size=4, load_tokenizer=False, dtype=cfg.embedded_engine_dtype()
            )
        )
    sync = WeightSync(engine, cfg.rollout, rank)
    for version in (1, 2):
        sync.push(model, role.hf, pgs, weight_version=str(version))
    sync.close()
    kept = sum(t.numel() * t.element_size() for t in engine._adapter.base.values()) if engine is not None else 0
    return dict(zip(PARTS, (weights, grads, adam, kept)))


def parts(config: str, overrides: list[str]) -> dict[str, int]:
    """Rank 0's measured bytes of PARTS for the config (its world and student layout; 2 gloo workers at most)."""
    from megaopd.config import load_config
    from megaopd.config.schema import MegaOPDConfig
    from megaopd.parallel.launch import spawn

    cfg = load_config(MegaOPDConfig, config, list(overrides))
    world = cfg.student.tp * cfg.student.pp
    return spawn(_parts_worker, world, args=(config, list(overrides)), timeout=900)[0]


def planned_parts(config: str, overrides: list[str]) -> dict[str, float]:
    """`megaopd plan`'s bytes (rank 0, on CPU) of PARTS; 0 for a part it has no item of."""
    from megaopd.config import load_config
    from megaopd.config.plan import plan_for
    from megaopd.config.schema import MegaOPDConfig

    plan = plan_for(load_config(MegaOPDConfig, config, [*overrides, "plan.device=cpu"]))
    return {part: sum(i.peak() for i in plan.items if i.name.startswith(part)) for part in PARTS}


def planned_gb(config: str, overrides: list[str]) -> float:
    """`megaopd plan`'s per-rank peak (rank 0) of the run, in GB, on CPU."""
    from megaopd.config import load_config
    from megaopd.config.plan import plan_for
    from megaopd.config.schema import MegaOPDConfig

    plan = plan_for(load_config(MegaOPDConfig, config, [*overrides, "plan.device=cpu"]))
    return plan.peak() / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="tiny_w2,smollm2_w1,smollm2_w2")
    p.add_argument("--models", default=DEFAULT_MODELS, help="folder of the SmolLM2 HF folders")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--prompts",
        type=int,
        default=2,
        help="SmolLM2 cases: prompts a step (x 2 samples); 2 keeps a "
        "world-2 run near 10 GB, what a shared 24 GiB machine had free",
    )
    p.add_argument("--out", default="", help="also write the results as JSON here")
    p.add_argument("--plan-only", action="store_true", help="print the plan's numbers, run nothing")
    p.add_argument("--parts", action="store_true", help="the plan's items measured one by one (tiny cases)")
    a = p.parse_args(argv)
    if a.parts:
        print("| case | item (rank 0) | plan bytes | measured bytes | plan / measured |")
        print("|---|---|---:|---:|---:|")
        for name, config in (("tiny_w2", "stable_opd.yaml"), ("tiny_lora_w2", "lora_opd.yaml")):
            config = os.path.join(ROOT, "examples/tiny", config)
            planned, measured = planned_parts(config, []), parts(config, [])
            for part in PARTS:
                ratio = f"{planned[part] / measured[part]:.3f}" if measured[part] else "-"
                print(f"| {name} | {part} | {planned[part]:,.0f} | {measured[part]:,} | {ratio} |")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan_vs_measured_") as tmp:
        known = cases(a.models, tmp, a.prompts)
        for name in a.cases.split(","):
            if name not in known:
                print(f"{name}: skipped (unknown case, or the SmolLM2 folders are not under {a.models})")
                continue
            case = known[name]
            overrides = [*case.overrides, f"trainer.max_steps={a.steps}"]
            plan = planned_gb(case.config, overrides)
            row = {"case": name, "world": case.world, "plan_gb": plan}
            if not a.plan_only:
                m = measure(case.config, overrides, os.path.join(tmp, name), case.world)
                if m["rc"] != 0:  # killed (the OOM killer of a shared machine): its peaks up to then
                    print(m["log"])
                    print(f"{name}: megaopd train exited {m['rc']}; peaks so far {m['peaks_gb']}", flush=True)
                row["rc"] = m["rc"]
                row.update(
                    measured_gb=max(m["peaks_gb"]),
                    ranks_gb=m["peaks_gb"],
                    tree_peak_gb=m["tree_peak_gb"],
                    seconds=m["seconds"],
                    ratio=plan / max(m["peaks_gb"]),
                )
            print(json.dumps(row), flush=True)
            if not a.plan_only and a.out:
                row["timeline"] = m["timeline"]
            rows.append(row)
            if a.out:  # after each case: a later one may be killed
                with open(a.out, "w") as f:
                    json.dump(rows, f)
    print("\n| case | world | plan GB (rank 0) | measured peak RSS GB (max rank; every rank) | plan / measured |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        if "measured_gb" in r:
            ranks = ", ".join(f"{x:.2f}" for x in r["ranks_gb"])
            print(
                f"| {r['case']} | {r['world']} | {r['plan_gb']:.2f} | {r['measured_gb']:.2f} ({ranks}) | "
                f"{r['ratio']:.2f}{'' if r['rc'] == 0 else ' (killed: exit ' + str(r['rc']) + ')'} |"
            )
        else:
            print(f"| {r['case']} | {r['world']} | {r['plan_gb']:.2f} | - | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
