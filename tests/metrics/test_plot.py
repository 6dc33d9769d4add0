"""`megaopd plot`: figures exist, are not blank, and missing keys are skipped."""

import json
import os

import numpy as np
from matplotlib.image import imread

from megaopd.cli import main as cli_main
from megaopd.metrics.plot import read_metrics


def _write_run(path, n_steps, collapse, keys=None):
    os.makedirs(path)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for s in range(n_steps):
            x = s / n_steps
            row = {
                "step": s,
                "rollout/truncation_rate": min(1.0, x**3 * 3) if collapse else 0.05,
                "rollout/repetition_rate": 0.5 * x if collapse else 0.01,
                "rollout/response_length_mean": 1000 + 3000 * x,
                "rollout/student_logprob_mean": -0.5 + 0.3 * x,
                "rollout/teacher_logprob_mean": -0.8 + 0.5 * x,
                "adv/regular_mean": -0.1,
                "adv/repetitive_mean": 0.2 * x,
                "train/note": "text values are ignored",
            }
            if s % 5 == 0:
                row.update(
                    {
                        "val/accuracy": 0.3 - 0.2 * x * collapse,
                        "val/answers_found": 0.9,
                        "val/truncation_rate": 0.1,
                        "val/repetition_rate": 0.0,
                    }
                )
            if keys is not None:
                row = {k: v for k, v in row.items() if k in keys or k == "step"}
            f.write(json.dumps(row) + "\n")
        f.write('{"step": 99, "rollout/trunc')  # a run killed mid-write


def _not_blank(path):
    img = imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 400
    # Not a single colour: plotted lines, text and axes vary the pixels.
    assert np.std(img[..., :3]) > 0.05
    assert os.path.getsize(path) > 10_000


def test_plot_two_runs_cli(tmp_path):
    _write_run(tmp_path / "opd", 40, collapse=True)
    _write_run(tmp_path / "stable_opd", 40, collapse=False)
    out = tmp_path / "figs"
    assert cli_main(["plot", str(tmp_path / "opd"), str(tmp_path / "stable_opd"), "--out", str(out)]) == 0
    for name in ("collapse.png", "dynamics.png"):
        _not_blank(out / name)


def test_plot_missing_keys_default_out(tmp_path):
    run = tmp_path / "partial"
    _write_run(run, 10, collapse=True, keys={"rollout/truncation_rate"})
    assert cli_main(["plot", str(run)]) == 0
    assert (run / "plots" / "collapse.png").exists()
    assert not (run / "plots" / "dynamics.png").exists()  # no panel of it has data


def test_plot_errors_and_reader(tmp_path):
    assert cli_main(["plot", str(tmp_path / "nope")]) == 2
    run = tmp_path / "empty"
    _write_run(run, 3, collapse=False, keys=set())
    assert cli_main(["plot", str(run)]) == 1
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "a": 1}\n{"step": 1, "a": 2, "b": NaN}\nnot json\n{"a": 3}\n'
        '{"step": 1, "event": "checkpoint", "message": "x", "value": 5}\n'
    )
    # The trainer's event records (checkpoints, warnings) must not replace the step's metrics.
    assert read_metrics(str(run / "metrics.jsonl")) == {1: {"step": 1.0, "a": 2.0}}


def test_plot_seed_bands(tmp_path):
    """--bands: runs under one parent folder are one line (mean, min-max band); band() is that arithmetic."""
    from megaopd.metrics.plot import band

    for arm, collapse in (("opd", True), ("stable_opd", False)):
        for seed in (1, 2):
            _write_run(tmp_path / arm / f"seed_{seed}", 20, collapse=collapse)
    out = tmp_path / "figs"
    runs = [str(tmp_path / a / f"seed_{s}") for a in ("opd", "stable_opd") for s in (1, 2)]
    assert cli_main(["plot", *runs, "--bands", "--out", str(out)]) == 0
    _not_blank(out / "collapse.png")
    group = [{0: {"x": 1.0}, 1: {"x": 2.0}}, {0: {"x": 3.0}}]
    assert band(group, "x") == ([0, 1], [2.0, 2.0], [1.0, 2.0], [3.0, 2.0])


def test_dynamics_show_validation_accuracy_and_answers_found(tmp_path):
    """What a user watches first (issue 54): validation accuracy and answers found over the steps, in the
    dynamics figure too; a run that logged only validation (SFT: no rollouts) still gets that figure."""
    from megaopd.metrics.plot import FIGURES

    (panel,) = [p for p in FIGURES["dynamics"] if p.title == "Validation"]
    assert [k for k, _, _ in panel.series] == ["val/accuracy", "val/answers_found"]
    run = tmp_path / "sft"
    _write_run(str(run), 20, collapse=False, keys={"val/accuracy", "val/answers_found"})
    assert cli_main(["plot", str(run)]) == 0
    _not_blank(run / "plots" / "dynamics.png")
