"""The permuted-vocabulary control of cross-tokenizer OPD, and what coarser spans cost (examples/tiny/README.md,
"The permuted-vocabulary control"; docs/algorithms.md 1.13).

    python examples/tiny/xtok_control.py                        # the control: same vs perm, seed 1, 10 steps
    python examples/tiny/xtok_control.py --arms same perm_span2 --seeds 1 2 3 --set optimizer.lr=3.0e-3
    python examples/tiny/xtok_control.py --report-only          # the tables of what has finished

Arms (every run one process on one thread: student, reference and teacher at TP=1; seed = trainer.seed =
data.seed; validation on the first 100 problems every 5 steps):
  same        plain OPD, examples/tiny/opd.yaml: the tiny teacher, the student's tokenizer (spans: none)
  perm        examples/tiny/cross_tokenizer.yaml with the tiny teacher PERMUTED (tools/permute_vocab.py: the
              same tokens under other ids, the embedding and output rows moved with them; built into
              OUT/teacher_perm): the cross-tokenizer path (re-tokenize, align by characters, span rewards)
              with every span one token. It must give `same`'s metrics to float round-off.
  perm_spanK  perm with every K consecutive spans of a response merged into one (K = 2, 4): an ideal teacher
              of coarser tokens, whose span log-prob is exactly the tiny teacher's log-prob of the span's text
              (a real coarser tokenizer would come with another model). Only the credit assignment differs
              from `same`: every token of a span gets the span's summed reward as its advantage. The trainer
              runs in this process (world size 1) with megaopd.data.teacher_view.align_response wrapped to
              merge the spans (coarsen below); the start-up `[vocab]` lines, computed before, still say one
              student token a span.

A run whose summary.json exists is not run again. Not run in CI (tests/data/test_permute_vocab.py is the
quick-tier pin of the same identity).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools"))

ONE_THREAD = ["run.world_size=1", "student.tp=1", "reference.tp=1", "teacher.tp=1"]
SETTINGS = [
    "trainer.max_steps=10",
    "trainer.eval_interval=5",
    "trainer.save_interval=1000",
    "validation.max_problems=100",
]
KEYS = ("loss/total", "opd/reverse_kl", "train/grad_norm", "rollout/response_length_mean", "val/accuracy")


def arm_command(out: str, arm: str) -> tuple[str, list[str], int]:
    """(preset, overrides, K: spans merged K at a time, 1 = as aligned) of an arm."""
    if arm == "same":
        return "examples/tiny/opd.yaml", [], 1
    if arm == "perm" or arm.startswith("perm_span"):
        k = int(arm[len("perm_span") :]) if arm != "perm" else 1
        return "examples/tiny/cross_tokenizer.yaml", [f"teacher.path={os.path.join(out, 'teacher_perm')}"], k
    raise ValueError(f"unknown arm {arm!r}: same, perm, perm_spanK (K >= 2)")


def run_dir(out: str, arm: str, seed: int) -> str:
    return os.path.join(out, arm, f"seed_{seed}")


def coarsen(alignment, k: int):
    """The SpanAlignment with every k consecutive spans merged into one (span s -> s // k on both sides)."""
    from megaopd.data.alignment import SpanAlignment

    def merge(spans):
        return [s // k if s >= 0 else -1 for s in spans]

    return SpanAlignment(
        student_span=merge(alignment.student_span),
        teacher_span=merge(alignment.teacher_span),
        n_spans=-(-alignment.n_spans // k),
    )


def train_coarse(k: int, argv: list[str]) -> int:
    """`megaopd train ARGV` in this process with every response's spans merged k at a time."""
    import megaopd.data.teacher_view as teacher_view
    from megaopd.trainer.cli import main

    aligned = teacher_view.align_response

    def align_coarse(student_tokenizer, teacher_tokenizer, ids):
        text, t_ids, alignment = aligned(student_tokenizer, teacher_tokenizer, ids)
        return text, t_ids, coarsen(alignment, k)

    teacher_view.align_response = align_coarse
    return main(argv)


def run_all(out: str, arms: list[str], seeds: list[int], parallel: int, extra: list[str]) -> None:
    from permute_vocab import permute_model

    if not os.path.isfile(os.path.join(out, "teacher_perm", "model.safetensors")):
        permute_model(os.path.join(ROOT, "examples/tiny/models/teacher"), os.path.join(out, "teacher_perm"), seed=0)
    env = dict(os.environ, MEGAOPD_WORKER_THREADS="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    todo = [(a, s) for s in seeds for a in arms if not os.path.exists(os.path.join(run_dir(out, a, s), "summary.json"))]
    running: list = []
    while todo or running:
        while todo and len(running) < parallel:
            arm, seed = todo.pop(0)
            preset, overrides, k = arm_command(out, arm)
            argv = [preset, f"run.dir={run_dir(out, arm, seed)}", *ONE_THREAD, *SETTINGS, *overrides, *extra]
            argv += [f"trainer.seed={seed}", f"data.seed={seed}"]
            cmd = [sys.executable, os.path.abspath(__file__), "--train-coarse", str(k), "--", *argv]
            if k == 1:
                cmd = [sys.executable, "-m", "megaopd.cli", "train", *argv]
            os.makedirs(run_dir(out, arm, seed), exist_ok=True)
            log = open(os.path.join(run_dir(out, arm, seed), "train.log"), "a")
            print(f"start {arm} seed {seed}", flush=True)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((proc, f"{arm} seed {seed}", time.time()))
        time.sleep(2)
        for item in list(running):
            proc, name, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}; see its train.log)"
                print(f"{status}: {name} in {time.time() - t0:.0f} s", flush=True)


def read_rows(path: str) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    if os.path.isfile(path):
        for line in open(path):
            obj = json.loads(line)
            if "event" not in obj:
                rows.setdefault(int(obj["step"]), {}).update(obj)
    return rows


def control_table(out: str, seed: int, other: str = "perm") -> str:
    """Per step: `same` and `other`'s metrics and their largest relative difference."""
    a, b = (
        read_rows(os.path.join(run_dir(out, "same", seed), "metrics.jsonl")),
        read_rows(os.path.join(run_dir(out, other, seed), "metrics.jsonl")),
    )
    lines = [
        f"| step | {' | '.join(KEYS)} (same / {other}) | largest relative difference |",
        f"| --- | {' | '.join('---' for _ in KEYS)} | --- |",
    ]
    for step in sorted(set(a) & set(b)):
        cells, worst = [], 0.0
        for key in KEYS:
            if key in a[step] and key in b[step]:
                x, y = a[step][key], b[step][key]
                worst = max(worst, abs(x - y) / max(abs(x), 1e-12))
                cells.append(f"{x:.7g} / {y:.7g}")
            else:
                cells.append("")
        lines.append(f"| {step} | {' | '.join(cells)} | {worst:.1e} |")
    return "\n".join(lines)


def mean_se(xs: list[float]) -> str:
    m = sum(xs) / len(xs)
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else float("nan")
    return f"{m:.3f} +/- {se:.3f}"


def arms_table(out: str, arms: list[str], seeds: list[int]) -> str:
    """Per arm: final val accuracy over seeds, and opd/reverse_kl over thirds of the run (mean over seeds)."""
    lines = ["| arm | seeds | final val accuracy | per seed | reverse KL, first / middle / last third of the steps |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for arm in arms:
        runs = [
            read_rows(os.path.join(run_dir(out, arm, s), "metrics.jsonl"))
            for s in seeds
            if os.path.exists(os.path.join(run_dir(out, arm, s), "summary.json"))
        ]
        if not runs:
            continue
        finals = [[r["val/accuracy"] for _, r in sorted(rows.items()) if "val/accuracy" in r][-1] for rows in runs]
        rkl = [[r["opd/reverse_kl"] for _, r in sorted(rows.items()) if "opd/reverse_kl" in r] for rows in runs]
        n = min(len(x) for x in rkl)
        thirds = [sum(sum(x[i * n // 3 : (i + 1) * n // 3]) / max(1, n // 3) for x in rkl) / len(rkl) for i in range(3)]
        lines.append(
            f"| {arm} | {len(runs)} | {mean_se(finals)} | {', '.join(f'{f:.2f}' for f in finals)} | "
            f"{' / '.join(f'{t:.3f}' for t in thirds)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--train-coarse"]:
        return train_coarse(int(argv[1]), argv[3:])
    ap = argparse.ArgumentParser(prog="xtok_control", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "tiny", "xtok_control"))
    ap.add_argument("--arms", nargs="+", default=["same", "perm"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[1])
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--set", nargs="*", default=[], help="overrides for every arm (key=value)")
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args(argv)
    if not a.report_only:
        run_all(a.out, a.arms, a.seeds, a.parallel, a.set)
    for seed in a.seeds:
        for other in (arm for arm in a.arms if arm != "same"):
            if "same" in a.arms:
                print(f"\nseed {seed}: same vs {other}\n{control_table(a.out, seed, other)}")
    print(f"\n{arms_table(a.out, a.arms, a.seeds)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
