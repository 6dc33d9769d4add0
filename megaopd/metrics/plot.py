"""`megaopd plot RUN [RUN ...] [--out DIR]`: training-dynamics figures from RUN/metrics.jsonl.

Two PNG figures in the layout of the Stable-OPD paper's figures 2 and 5, one line colour per run
(legend = the run folder's name):
    collapse.png  truncation rate | repetition rate | validation accuracy
                  (solid: training rollouts, dashed with markers: validation generations)
    dynamics.png  validation accuracy (solid) and answers found (dashed: responses with an answer to grade) |
                  response length | student (solid) and teacher (dashed) log-prob |
                  advantage of regular (solid) vs repetitive (dashed) tokens
Panels whose keys no run logged are left out; a figure with no panel is not written. metrics.jsonl holds
one JSON object per step with "step"; lines that do not parse (a run killed mid-write) are skipped, and
when a resumed run logged a step twice the later line wins.

Output goes to RUN/plots/ of the first RUN, or to --out DIR.

With --bands, runs that share a parent folder (study/opd/seed_1, study/opd/seed_2, ...) are one line,
named after the parent: the mean over its runs at each step, with a shaded band from their minimum to
their maximum (the seed band). A third figure, controller.png, shows the adaptive controller's weights
(loss.controller=adaptive) when a run logged them.

    megaopd plot runs/opd runs/stable_opd --out figs/
    megaopd plot study/*/seed_* --bands --out figs/
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass

# Series of one panel: (metric key, line style, label suffix).
Series = tuple[str, str, str]


@dataclass
class Panel:
    title: str
    ylabel: str
    series: list[Series]
    rate: bool = False
    """y is a fraction in [0, 1]: fix the axis so that runs compare at a glance."""


FIGURES: dict[str, list[Panel]] = {
    "collapse": [
        Panel(
            "Truncation rate",
            "fraction",
            [("rollout/truncation_rate", "-", "rollout"), ("val/truncation_rate", "--o", "val")],
            rate=True,
        ),
        Panel(
            "Repetition rate",
            "fraction",
            [("rollout/repetition_rate", "-", "rollout"), ("val/repetition_rate", "--o", "val")],
            rate=True,
        ),
        Panel("Validation accuracy", "accuracy", [("val/accuracy", "-o", "")], rate=True),
    ],
    "dynamics": [
        Panel(
            "Validation",
            "fraction of problems",
            [("val/accuracy", "-o", "accuracy"), ("val/answers_found", "--s", "answers found")],
            rate=True,
        ),
        Panel("Response length", "tokens", [("rollout/response_length_mean", "-", "")]),
        Panel(
            "Log-probs of sampled tokens",
            "mean log-prob",
            [("rollout/student_logprob_mean", "-", "student"), ("rollout/teacher_logprob_mean", "--", "teacher")],
        ),
        Panel(
            "Advantage",
            "mean advantage",
            [("adv/regular_mean", "-", "regular"), ("adv/repetitive_mean", "--", "repetitive")],
        ),
    ],
    "controller": [
        Panel("Golden-mix weight (sft_weight)", "weight", [("controller/sft_weight", "-", "")]),
        Panel("Reference-KL coefficient (ref_kl_weight)", "weight", [("controller/ref_kl_weight", "-", "")]),
        Panel("Controller pressure", "pressure", [("controller/pressure", "-", "")]),
    ],
}


def read_metrics(path: str) -> dict[int, dict[str, float]]:
    """step -> {key: float} from a metrics.jsonl; skips unparsable lines, non-numeric values and event
    records ({"step", "event", ...}: checkpoints, collapse warnings), which carry a step but no metrics."""
    rows: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for line in f:
            try:
                obj = json.loads(line)
                step = int(obj["step"])
            except (ValueError, KeyError, TypeError):
                continue
            if "event" in obj:
                continue
            rows[step] = {
                k: float(v)
                for k, v in obj.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
            }
    return rows


def series(rows: dict[int, dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    steps = sorted(s for s, r in rows.items() if key in r)
    return steps, [rows[s][key] for s in steps]


def band(group: list[dict[int, dict[str, float]]], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, mean, min and max of `key` over the runs of a group (each step over the runs that logged it)."""
    steps = sorted({s for rows in group for s, r in rows.items() if key in r})
    values = [[rows[s][key] for rows in group if key in rows.get(s, {})] for s in steps]
    return steps, [sum(v) / len(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def plot_runs(
    runs: dict[str, dict[int, dict[str, float]] | list[dict[int, dict[str, float]]]], out_dir: str
) -> list[str]:
    """Draws FIGURES for the named runs into out_dir; returns the paths written. A value that is a list
    of runs (seeds) is drawn as its mean with a min-max band."""
    runs = {name: rows if isinstance(rows, list) else [rows] for name, rows in runs.items()}
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster and CI nodes
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = []
    for fig_name, panels in FIGURES.items():
        present = [
            p
            for p in panels
            if any(series(rows, k)[0] for group in runs.values() for rows in group for k, _, _ in p.series)
        ]
        if not present:
            continue
        fig, axes = plt.subplots(1, len(present), figsize=(5 * len(present), 3.8), squeeze=False)
        for ax, panel in zip(axes[0], present):
            for i, (run_name, group) in enumerate(runs.items()):
                for key, style, suffix in panel.series:
                    x, y, lo, hi = band(group, key)
                    if not x:
                        continue
                    label = f"{run_name} ({suffix})" if suffix else run_name
                    if len(group) > 1:
                        label += f" (mean of {len(group)}, band min-max)"
                        ax.fill_between(x, lo, hi, color=colors[i % len(colors)], alpha=0.18, linewidth=0)
                    ax.plot(x, y, style, color=colors[i % len(colors)], label=label, linewidth=1.5, markersize=3)
            ax.set_title(panel.title)
            ax.set_xlabel("step")
            ax.set_ylabel(panel.ylabel)
            if panel.rate and ax.dataLim.y1 <= 1.0:  # a run that logs percent keeps auto limits
                ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{fig_name}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megaopd plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RUN", help="run folders holding metrics.jsonl")
    ap.add_argument("--out", default=None, help="output folder (default: RUN/plots of the first RUN)")
    ap.add_argument(
        "--bands",
        action="store_true",
        help="one line per parent folder: the mean of its runs (seeds) with a min-max band",
    )
    args = ap.parse_args(argv)
    runs = {}
    for run in args.runs:
        path = os.path.join(run, "metrics.jsonl")
        if not os.path.isfile(path):
            print(f"megaopd plot: {path} not found; pass run folders written by `megaopd train`", file=sys.stderr)
            return 2
        if args.bands:
            runs.setdefault(os.path.basename(os.path.dirname(os.path.normpath(run))), []).append(read_metrics(path))
            continue
        name = os.path.basename(os.path.normpath(run))
        while name in runs:  # two runs with one folder name (a/run, b/run): keep both
            name += "'"
        runs[name] = read_metrics(path)
    out_dir = args.out or os.path.join(args.runs[0], "plots")
    written = plot_runs(runs, out_dir)
    if not written:
        print("megaopd plot: none of the plotted keys appear in the metrics; nothing written", file=sys.stderr)
        return 1
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
