"""`megaopd train CONFIG [key=value ...]`: run (or resume) an OPD job.

On a machine without torchrun in charge (no WORLD_SIZE in the environment) it starts run.world_size
local workers itself (gloo on CPU); under torchrun or srun it is one rank of the job. The run folder
run.dir gets config.yaml, metrics.jsonl, tb/, samples/, checkpoints/, eval/, hf/ (the final student),
plots/ and summary.json. Starting the same command again resumes from the last checkpoint; SIGTERM or
SIGUSR1 saves a checkpoint and exits 0.

A resume compares its config with the run's config.yaml before writing anything (trainer/resume_config.py):
a change the checkpoint cannot take (another model, dtype, the distributed optimizer's layout, ...) is refused
in one line naming the keys, and the run folder is left as it was; any other change applies from the resumed
step and is printed, one line a key (`config changed at step 40: optimizer.lr 0.0005 -> 0.01`). config.yaml is
then the config now running, and RUN/configs/step_NNNNNN.yaml keeps the config of each start at step NNNNNN
(a second start at the same step with another config: step_NNNNNN.1.yaml, ...).

An error raised in a rank ends the command with one line naming the rank and the exception, exit 1; its
traceback goes to RUN/logs/rank_R.err.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import traceback
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from megaopd.config import ConfigError, load_config, to_yaml
from megaopd.config.schema import MegaOPDConfig

if TYPE_CHECKING:
    from megaopd.trainer.run_log import RunSummary


def _resume_point(run_dir: str) -> tuple[str | None, int]:
    """The checkpoint a start of this run folder resumes from, and its step ((None, 0): a fresh start).
    Read-only (run_folder.planned_resume): a refused resume leaves the folder as it was."""
    if not os.path.isdir(os.path.join(run_dir, "checkpoints")):
        return None, 0
    from megaopd.trainer.run_folder import planned_resume

    return planned_resume(run_dir)


def _prepare_run_dir(cfg: MegaOPDConfig) -> list[str]:
    """Checks a resume's config against the stored one, then writes config.yaml and its history. Returns the
    change lines to print; raises ValueError (nothing written) when a change cannot apply."""
    from megaopd.trainer.resume_config import config_changes, refusal, unappliable

    text = to_yaml(cfg)
    stored = os.path.join(cfg.run.dir, "config.yaml")
    latest, step = (None, 0) if cfg.run.start_over else _resume_point(cfg.run.dir)  # start_over: nothing resumed
    lines = []
    if latest is not None and os.path.isfile(stored):
        changes = config_changes(
            OmegaConf.to_container(OmegaConf.load(stored)), OmegaConf.to_container(OmegaConf.create(text))
        )
        refused = unappliable(changes, cfg, latest)
        if refused:
            raise ValueError(refusal(cfg.run.dir, step, refused))
        lines = [c.line(step) for c in changes]
    history = os.path.join(cfg.run.dir, "configs")
    os.makedirs(history, exist_ok=True)
    _write(stored, text)
    name, n = f"step_{step:06d}", 0
    while os.path.exists(os.path.join(history, f"{name}.yaml")):
        with open(os.path.join(history, f"{name}.yaml")) as f:
            if f.read() == text:
                return lines
        n += 1
        name = f"step_{step:06d}.{n}"
    _write(os.path.join(history, f"{name}.yaml"), text)
    return lines


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _rank_failed(cfg: MegaOPDConfig, rank: int | None, summary: str, details: str) -> int:
    """One line on the terminal; the traceback in RUN/logs/rank_R.err."""
    where = ""
    if details:
        logs = os.path.join(cfg.run.dir, "logs")
        os.makedirs(logs, exist_ok=True)
        path = os.path.join(logs, f"rank_{rank}.err")
        with open(path, "w") as f:
            f.write(details)
        where = f" (traceback: {path})"
    who = f"rank {rank}" if rank is not None else "the ranks"
    print(f"megaopd train: {who} failed: {summary}{where}", file=sys.stderr, flush=True)
    return 1


def run_worker(rank: int, world_size: int, cfg: MegaOPDConfig) -> RunSummary | None:
    """One rank of `megaopd train` (a spawned worker, or the torchrun / srun process itself).

    The trainer (megatron-core, transformers: ~11 s of imports on a 2-core CPU) is imported here, in the rank,
    not at the top: the process that only launches the ranks would otherwise import it too, before they start.
    The preemption flag comes first: a SIGTERM or USR1 during those imports and the models' builds (minutes at
    7B) is then kept for the first step's check. Without the flag a rank under torchrun would ignore the signal
    (it inherits torchrun's ignored USR1) and one spawned here would die of it.
    """
    from megaopd.trainer.preemption import PreemptionFlag

    preemption = PreemptionFlag()
    if "GROUP_RANK" in os.environ:  # under torchrun (GROUP_RANK: its node rank): which rank runs on which node
        print(
            f"megaopd train: rank {rank}/{world_size} on {socket.gethostname()} (node rank "
            f"{os.environ['GROUP_RANK']}, local rank {os.environ.get('LOCAL_RANK')})\n",
            end="",  # one write with its newline: the ranks of a node share one stream, whole lines each
            flush=True,
        )
    from megaopd.trainer.trainer import Trainer

    trainer = Trainer(cfg, preemption=preemption)
    summary = trainer.train()
    if trainer.run_log is not None:
        trainer.run_log.close()
    return summary if rank == 0 else None


def _print_summary(cfg: MegaOPDConfig, summary: RunSummary) -> None:
    from megaopd.trainer.run_log import write_summary

    last = summary.last_metrics  # the logged metrics, by their log names
    before = (summary.val_before or {}).get("val/accuracy")
    after = last.get("val/accuracy")
    lines = [f"run {cfg.run.dir}: {summary.start_step} -> {summary.end_step} steps"]
    if before is not None and after is not None:
        lines.append(f"  validation accuracy   {before:.3f} -> {after:.3f}")
    for key, label in (
        ("rollout/truncation_rate", "truncation rate"),
        ("rollout/repetition_rate", "repetition rate"),
        ("val/truncation_rate", "val truncation rate"),
        ("val/repetition_rate", "val repetition rate"),
    ):
        if last.get(key) is not None:
            lines.append(f"  {label:<21} {last[key]:.3f}")
    if summary.step_time_mean is not None:
        lines.append(f"  {'time per step (s)':<21} {summary.step_time_mean:.3f}")
    lines.append(f"  summary: {write_summary(cfg.run.dir, summary)}")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or "=" in argv[0]:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        cfg = load_config(MegaOPDConfig, argv[0], argv[1:])
    except ConfigError as e:
        print(f"megaopd train: {e}", file=sys.stderr)
        return 2
    from megaopd.parallel.launch import run_on_ranks, under_launcher

    if under_launcher() and int(os.environ["WORLD_SIZE"]) != cfg.run.world_size:
        print(
            f"megaopd train: the launcher started {os.environ['WORLD_SIZE']} ranks but run.world_size="
            f"{cfg.run.world_size}; pass run.world_size={os.environ['WORLD_SIZE']}",
            file=sys.stderr,
        )
        return 2
    import torch

    from megaopd.trainer.machine import gpu_only_settings, have_transformer_engine

    problems = gpu_only_settings(cfg, torch.cuda.is_available(), have_transformer_engine())
    if problems:  # before any rank starts: these fail minutes later deep in megatron
        print("\n".join(f"megaopd train: {p}" for p in problems), file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            for line in _prepare_run_dir(cfg):
                print(line, flush=True)
        except (ValueError, FileNotFoundError) as e:
            print(f"megaopd train: {e}", file=sys.stderr)
            return 2
    from megaopd.parallel.launch import WorkerError, one_line

    try:
        results = run_on_ranks(
            run_worker,
            cfg.run.world_size,
            args=(cfg,),
            timeout=7 * 24 * 3600,
            forward_signals=(signal.SIGTERM, signal.SIGUSR1),
        )
    except WorkerError as e:  # a spawned rank raised: its traceback came with the error
        return _rank_failed(cfg, e.rank, e.summary, e.details)
    except Exception as e:  # noqa: BLE001 - this process is the rank (torchrun / srun, or world size 1)
        return _rank_failed(cfg, int(os.environ.get("RANK", "0")), one_line(e), traceback.format_exc())
    summary = results[0]
    if summary is not None and not summary.preempted:
        _print_summary(cfg, summary)
        try:
            from megaopd.metrics.plot import main as plot_main

            plot_main([cfg.run.dir])
        except Exception as e:  # noqa: BLE001 - figures are a convenience; the run itself succeeded
            print(f"megaopd train: could not draw the figures ({e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
