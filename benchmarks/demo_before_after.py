"""The tiny demo's time per step on two source trees of megaopd, runs alternated (before, after, before, after, ...)
so that a shared machine's load falls on both alike. Written for issue 43: does the happy path cost more with
the checks (manifests hashed on save and verified on load, the restricted unpickler, the resume's config
compare, the stall watch)?

Each run is `megaopd train examples/tiny/stable_opd.yaml` on that tree's code (PYTHONPATH and cwd: the tree) in
a fresh run folder, with --steps steps, a checkpoint every --save-interval steps and no validation (the
validation passes are the same code in both trees and only add noise). From each run's metrics.jsonl:

    s/step     median of time/step over the run's steps (rollout, scoring, training, weight sync; not the save)
    save s     median over the saves that have a next step of: next row's time - this row's - next time/step
               (the save and the logging between two steps; the last save has no next row)
    other s    the same gap after steps without a save (what the save's gap is compared with)
    wall s     the command's whole time (start-up, model loads, the engine's first sync, every save, the export)

With --validate each run also validates before the first step and after the last (trainer.eval_interval=--steps)
and the last step's val/accuracy and opd/reverse_kl are printed per run: with the same seeds two trees that
compute the same thing print the same numbers (what a refactor must keep).

    python benchmarks/demo_before_after.py --before /work/wt/before            # 2 pairs of 8-step runs
    python benchmarks/demo_before_after.py --before-commit cfbaab8 --pairs 1 --steps 4 --per-step

--before-commit checks that commit out with `git worktree add` into a temporary folder (removed afterwards) and
uses it as the before tree. --per-step validates after every step (trainer.eval_interval=1, on --val-problems
problems) and prints, per step, val/accuracy and opd/reverse_kl of both trees and whether they are identical
(issue 52: a refactor that keeps the behaviour keeps these to the last digit), and whether every step's
metrics.jsonl row has the same keys.
    python benchmarks/demo_before_after.py --before OLD --after NEW --pairs 3 --steps 6
    python benchmarks/demo_before_after.py --before OLD --after NEW --pairs 2 --steps 6 --validate
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = "examples/tiny/stable_opd.yaml"


def one_run(tree: str, run_dir: str, steps: int, save_interval: int, validate: bool, per_step: int = 0) -> dict:
    """per_step > 0: validate after every step on that many problems (and before the first)."""
    cmd = [
        sys.executable,
        "-m",
        "megaopd.cli",
        "train",
        PRESET,
        f"run.dir={run_dir}",
        f"trainer.max_steps={steps}",
        f"trainer.save_interval={save_interval}",
        f"trainer.eval_interval={1 if per_step else steps if validate else 0}",
        "logging.progress_bar=off",
    ] + ([f"validation.max_problems={per_step}"] if per_step else [])
    t0 = time.perf_counter()
    r = subprocess.run(
        cmd, cwd=tree, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, timeout=1800
    )
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{tree}: {' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        logged = [r for r in map(json.loads, f) if "event" not in r]
    rows = {r["step"]: r for r in logged if "time/step" in r}  # not the validation before the first step
    step_s = [rows[s]["time/step"] for s in sorted(rows)]
    save_gaps, other_gaps = [], []
    for s in sorted(rows):
        # the gap between two rows that is not the next step's own time (the last row's holds its validation)
        if s + 1 in rows and not (validate and s + 1 == max(rows)):
            gap = rows[s + 1]["time"] - rows[s]["time"] - rows[s + 1]["time/step"]
            (save_gaps if s % save_interval == 0 else other_gaps).append(gap)
    last = {k: v for r in logged if r["step"] == max(rows) for k, v in r.items()}  # the step's rows together
    final = {k: last.get(k) for k in ("val/accuracy", "opd/reverse_kl")}
    by_step: dict[int, dict] = {}
    for row in logged:  # a step's rows together (validation before the first step: step 0)
        by_step.setdefault(row["step"], {}).update(row)
    steps_seen = {s: {k: r.get(k) for k in ("val/accuracy", "opd/reverse_kl")} for s, r in sorted(by_step.items())}
    return {
        "step_s": step_s,
        "save_s": save_gaps,
        "other_s": other_gaps,
        "wall_s": wall,
        "final": final,
        "per_step": steps_seen,
        "keys": {s: sorted(k for k in r if k != "time") for s, r in sorted(by_step.items())},
    }


def per_step_table(before: dict, after: dict) -> tuple[str, bool]:
    """A markdown table of each step's val/accuracy and opd/reverse_kl in both trees, and whether all agree."""
    lines = [
        "| step | val/accuracy before | after | opd/reverse_kl before | after | identical |",
        "| ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    same_all = True
    for step in sorted(set(before) | set(after)):
        b, a = before.get(step, {}), after.get(step, {})
        same = b == a
        same_all &= same
        lines.append(
            f"| {step} | {b.get('val/accuracy')} | {a.get('val/accuracy')} | {b.get('opd/reverse_kl')} | "
            f"{a.get('opd/reverse_kl')} | {'yes' if same else 'NO'} |"
        )
    return "\n".join(lines), same_all


def worktree_at(commit: str, where: str) -> str:
    """A checkout of `commit` of this repository at `where` (git worktree add --detach)."""
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", where, commit], check=True, capture_output=True)
    return where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="the older megaopd source tree")
    ap.add_argument("--before-commit", help="or a commit of this repository, checked out into a temporary folder")
    ap.add_argument("--after", default=ROOT, help="the newer one (default: this tree)")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-interval", type=int, default=2)
    ap.add_argument("--validate", action="store_true", help="validate at the start and the end; print the metrics")
    ap.add_argument("--per-step", action="store_true", help="validate every step; print the per-step table")
    ap.add_argument("--val-problems", type=int, default=64, help="validation problems with --per-step")
    a = ap.parse_args()
    if (a.before is None) == (a.before_commit is None):
        ap.error("give one of --before (a tree) or --before-commit (a commit of this repository)")
    med = statistics.median

    with tempfile.TemporaryDirectory() as tmp:
        before = os.path.abspath(a.before) if a.before else worktree_at(a.before_commit, os.path.join(tmp, "before"))
        try:
            runs = _runs({"before": before, "after": os.path.abspath(a.after)}, a, tmp)
        finally:
            if a.before_commit:
                subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", before], capture_output=True)
    _report(runs, a, med)


def _runs(trees: dict[str, str], a, tmp: str) -> dict[str, list[dict]]:
    """--pairs runs of each tree, alternated."""
    med = statistics.median
    runs = {name: [] for name in trees}
    for i in range(a.pairs):
        for name, tree in trees.items():
            r = one_run(
                tree,
                os.path.join(tmp, f"{name}_{i}"),
                a.steps,
                a.save_interval,
                a.validate,
                a.val_problems if a.per_step else 0,
            )
            runs[name].append(r)
            print(
                f"pair {i} {name:6}: s/step {med(r['step_s']):.3f}, save {med(r['save_s']):.3f} s, "
                f"other gap {med(r['other_s']):.3f} s, wall {r['wall_s']:.1f} s"
                + "".join(f", {k} {v!r}" for k, v in r["final"].items() if v is not None),
                flush=True,
            )
    return runs


def _report(runs: dict[str, list[dict]], a, med) -> None:
    trees = list(runs)
    if a.per_step:
        for i in range(a.pairs):
            table, same = per_step_table(runs["before"][i]["per_step"], runs["after"][i]["per_step"])
            print(f"\npair {i}: per step (step 0: validation before the first step)\n{table}")
            print(f"identical: {'yes' if same else 'NO'}")
            kb, ka = runs["before"][i]["keys"], runs["after"][i]["keys"]
            differ = {s: sorted(set(kb.get(s, [])) ^ set(ka.get(s, []))) for s in set(kb) | set(ka)}
            differ = {s: d for s, d in differ.items() if d}
            print(f"metrics.jsonl keys identical at every step: {'yes' if not differ else f'NO {differ}'}")
    cols = ("step_s", "save_s", "other_s", "wall_s")
    pooled = {
        name: {c: med([v for r in rs for v in (r[c] if c != "wall_s" else [r[c]])]) for c in cols}
        for name, rs in runs.items()
    }
    print(
        f"\n{'':12} {'s/step':>8} {'save s':>8} {'other s':>8} {'wall s':>8}   (medians over {a.pairs} runs of "
        f"{a.steps} steps each, a save every {a.save_interval})"
    )
    for name in trees:
        print(f"{name:12} " + " ".join(f"{pooled[name][c]:8.3f}" for c in cols))
    print(f"{'after/before':12} " + " ".join(f"{pooled['after'][c] / pooled['before'][c]:8.2f}" for c in cols))


if __name__ == "__main__":
    main()
