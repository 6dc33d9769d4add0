"""The real-model example's table and figure, from what examples/real/run_all.sh wrote into runs/real/.

    python examples/real/report.py --runs runs/real      # -> examples/real/results.json, the table, the figure
    python examples/real/report.py                        # only redraw from the committed results.json

Per arm (runs/real/<arm>/metrics.jsonl, measure_<arm>.json, nll_after_<arm>.json, eval_<arm>_number/): accuracy
on the validation problems with the number extraction (`megaopd eval`) of the pruned student before and of the
run's final student `hf/` after (and how many answers were found), golden NLL
before (nll_before.json: the pruned student) and after (the run's final student `hf/`), the mean s/step, the
run's wall time and the peak memory of its process tree. Plus the `megaopd eval` results of teacher and
student with the number and the boxed extraction (eval_<who>_<extract>/results.json).
"""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results.json")
FIGURE = os.path.join(HERE, "compress_and_distill.png")
ARMS = ("stable_opd", "opd", "sft")


def _load(path: str):
    with open(path) as f:
        return json.load(f)


def _steps(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def collect(runs: str) -> dict:
    nll_before = list(_load(os.path.join(runs, "nll_before.json")).values())  # [teacher, student]
    out = {"teacher_nll": nll_before[0]["nll"], "student_nll": nll_before[1]["nll"], "evals": {}, "arms": {}}
    for who in ("teacher", "student"):
        for extract in ("number", "boxed"):
            path = os.path.join(runs, f"eval_{who}_{extract}", "results.json")
            if os.path.exists(path):
                r = _load(path)
                out["evals"][f"{who}/{extract}"] = {
                    "accuracy": r["average"],
                    "answers_found": r["answers_found"],
                    "responses": r["responses"],
                }
    before = out["evals"].get("student/number")
    for arm in ARMS:
        run = os.path.join(runs, arm)
        measure_path = os.path.join(runs, f"measure_{arm}.json")
        if not (os.path.exists(os.path.join(run, "metrics.jsonl")) and os.path.exists(measure_path)):
            continue
        steps = [r for r in _steps(run) if "time/step" in r and "event" not in r]
        measure = _load(measure_path)
        a = {
            "acc_before": before["accuracy"],
            "found_before": before["answers_found"],
            "nll_before": out["student_nll"],
            "acc_after": None,
            "found_after": None,
            "nll_after": None,
            "steps": len(steps),
            "s_per_step": sum(r["time/step"] for r in steps) / len(steps) if steps else None,
            "wall_s": measure["seconds"],
            "peak_pss_gb": measure["peak_pss_gb"],
            "finished": measure["returncode"] == 0,
            "loss": [r.get("loss/total") for r in steps],
            "step_s": [r["time/step"] for r in steps],
        }
        after_path = os.path.join(runs, f"eval_{arm}_number", "results.json")
        nll_path = os.path.join(runs, f"nll_after_{arm}.json")
        if os.path.exists(after_path):
            after = _load(after_path)
            a.update(acc_after=after["average"], found_after=after["answers_found"], responses=after["responses"])
        if os.path.exists(nll_path):
            a["nll_after"] = list(_load(nll_path).values())[0]["nll"]
        out["arms"][arm] = a
    return out


def table(res: dict) -> str:
    lines = [
        "| arm | accuracy before -> after (answers found of 60) | golden NLL before -> after | s/step | "
        "steps | run wall time | peak memory (PSS) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, a in res["arms"].items():
        acc = (
            f"{a['acc_before']:.3f} -> **{a['acc_after']:.3f}** ({a['found_before']} -> {a['found_after']})"
            if a["acc_after"] is not None
            else f"{a['acc_before']:.3f} -> not measured"
        )
        nll = (
            f"{a['nll_before']:.3f} -> **{a['nll_after']:.3f}**"
            if a["nll_after"] is not None
            else f"{a['nll_before']:.3f} -> not measured"
        )
        steps = f"{a['steps']}" + ("" if a["finished"] else " (stopped)")
        s_step = f"{a['s_per_step']:.0f}" if a["s_per_step"] is not None else "-"
        lines.append(
            f"| `{arm}` | {acc} | {nll} | {s_step} | {steps} | {a['wall_s'] / 60:.1f} min | {a['peak_pss_gb']:.1f} GB |"
        )
    return "\n".join(lines)


def draw(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a, v in res["arms"].items() if v["acc_after"] is not None and v["nll_after"] is not None]
    fig, (ax_acc, ax_nll, ax_t) = plt.subplots(1, 3, figsize=(14, 3.8))
    x = range(len(arms))
    w = 0.38
    for ax, key, label in (
        (ax_acc, "acc", "validation accuracy (number extraction, greedy)"),
        (ax_nll, "nll", "golden NLL per token (validation)"),
    ):
        before = [res["arms"][a][f"{key}_before"] for a in arms]
        after = [res["arms"][a][f"{key}_after"] for a in arms]
        ax.bar([i - w / 2 for i in x], before, w, label="pruned student, before", color="#bbbbbb")
        ax.bar([i + w / 2 for i in x], after, w, label="after training", color="#3a6ea5")
        for i, (v0, v) in enumerate(zip(before, after)):
            for value, at in ((v0, i - w / 2), (v, i + w / 2)):
                label = f"{value:.3f}" if key == "nll" else f"{round(value * 60)}/60"  # 60 validation problems
                ax.annotate(label, (at, value), ha="center", va="bottom", fontsize=8)
        teacher = res["evals"].get("teacher/number", {}).get("accuracy") if key == "acc" else res["teacher_nll"]
        if teacher is not None:
            ax.axhline(teacher, color="#c0504d", ls="--", lw=1, label="full model (teacher)")
        ax.set_xticks(list(x), arms)
        ax.set_title(label, fontsize=10)
    ax_acc.legend(fontsize=8, loc="upper left")
    for arm, a in res["arms"].items():  # every arm, finished or stopped
        ax_t.plot(
            range(1, len(a["step_s"]) + 1), a["step_s"], marker="o", label=arm + ("" if a["finished"] else " (stopped)")
        )
    ax_t.set_xlabel("step")
    ax_t.set_title("seconds per step (shared, loaded 2-core CPU)", fontsize=10)
    ax_t.legend(fontsize=8)
    fig.suptitle(
        "SmolLM2-135M-Instruct without layers 16-19, taught by the full model: "
        "6 steps x 4 prompts per arm (arms that finished)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", help="run_all.sh's output folder; without it, redraw from results.json")
    args = p.parse_args()
    if args.runs:
        res = collect(args.runs)
        with open(RESULTS, "w") as f:
            json.dump(res, f, indent=1)
    else:
        res = _load(RESULTS)
    print(table(res))
    for name, e in res["evals"].items():
        print(
            f"megaopd eval {name}: accuracy {e['accuracy']:.3f}, "
            f"answers found: {e['answers_found']} of {e['responses']}"
        )
    draw(res, FIGURE)
    print(f"figure: {FIGURE}")


if __name__ == "__main__":
    main()
