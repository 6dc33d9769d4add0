"""`megaopd train CONFIG [key=value ...]`: run (or resume) an OPD job.

On a machine without torchrun in charge (no WORLD_SIZE in the environment) it starts run.world_size
local workers itself (gloo on CPU); under torchrun or srun it is one rank of the job. The run folder
run.dir gets config.yaml, metrics.jsonl, tb/, samples/, checkpoints/, eval/, hf/ (the final student),
plots/ and summary.json. Starting the same command again resumes from the last checkpoint; SIGTERM or
SIGUSR1 saves a checkpoint and exits 0.

One run per folder: the process that starts the run (the launcher of local workers, or rank 0 under torchrun /
srun) takes an flock on RUN/run.lock for the run's life (the OS drops it when that process ends, SIGKILL
included); a second `megaopd train` on the folder stops in one line naming the holder (host, pid, since when)
before it writes anything.

A resume compares its config with the run's config.yaml, and the checkpoint's trainer_state.json (its step
against the manifest's, its data order) with the config, before writing anything (trainer/resume_config.py):
a change the checkpoint cannot take (another model, dtype, the distributed optimizer's layout, the data order,
...) is refused in one line naming the keys, and the run folder is left as it was; any other change applies
from the resumed step and is printed, one line a key (`config changed at step 40: optimizer.lr 0.0005 ->
0.01`). Rank 0 writes config.yaml (the config now running) and RUN/configs/step_NNNNNN.yaml (the config of
each start at step NNNNNN; a second start at the same step with another config: step_NNNNNN.1.yaml, ...) only
once the checkpoint has loaded: what only a rank can refuse (a data source's rows changed, the checkpoint's
shapes) leaves them as they were too.

An error raised in a rank ends the command with one line naming the rank and the exception, exit 1; its
traceback goes to RUN/logs/rank_R.err.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ConfigRecord:
    """What a start writes of its config once its resume has loaded (`record_config`): config.yaml and its copy
    under configs/, and the change lines to print. Checked before any rank starts (`check_resume`), written by
    rank 0 only after the checkpoint loaded: a resume refused by a rank (the sampler's state, a shape) leaves the
    folder as it was."""

    text: str
    """The resolved config as YAML."""
    lines: list[str]
    """`config changed at step N: key old -> new`, one a changed key."""


def check_resume(cfg: MegaOPDConfig) -> ConfigRecord:
    """Compares a resume's config with the stored config.yaml and the checkpoint's saved state; raises
    ValueError (one line, nothing written) when the resume cannot apply it. Reads only."""
    from megaopd.trainer.resume_config import config_changes, refusal, saved_state_refusals, unappliable

    text = to_yaml(cfg)
    stored = os.path.join(cfg.run.dir, "config.yaml")
    latest, step = (None, 0) if cfg.run.start_over else _resume_point(cfg.run.dir)  # start_over: nothing resumed
    lines: list[str] = []
    if latest is not None:
        refused = saved_state_refusals(cfg, latest, step)
        if os.path.isfile(stored):
            try:
                old = OmegaConf.to_container(OmegaConf.load(stored))
            except Exception as e:  # noqa: BLE001 - any YAML or OmegaConf error: the file is not a config
                raise ValueError(
                    f"{stored} is not a readable config ({type(e).__name__}: {str(e).splitlines()[0][:200]}): "
                    f"restore it (configs/step_*.yaml keeps each start's config), or delete it to resume "
                    f"without the change check"
                ) from None
            if not isinstance(old, dict):
                raise ValueError(
                    f"{stored} is not a config mapping: restore it (configs/step_*.yaml keeps each start's "
                    f"config), or delete it to resume without the change check"
                )
            changes = config_changes(old, OmegaConf.to_container(OmegaConf.create(text)))
            refused = unappliable(changes, cfg, latest) + refused
            lines = [c.line(step) for c in changes]
        if refused:
            raise ValueError(refusal(cfg.run.dir, step, refused))
    return ConfigRecord(text, lines)


def record_config(cfg: MegaOPDConfig, record: ConfigRecord, step: int) -> list[str]:
    """Writes config.yaml and configs/step_NNNNNN[.n].yaml (`step`: the step the run starts at); returns the
    change lines to print."""
    history = os.path.join(cfg.run.dir, "configs")
    os.makedirs(history, exist_ok=True)
    text = record.text
    _write(os.path.join(cfg.run.dir, "config.yaml"), text)
    name, n = f"step_{step:06d}", 0
    while os.path.exists(os.path.join(history, f"{name}.yaml")):
        with open(os.path.join(history, f"{name}.yaml")) as f:
            if f.read() == text:
                return record.lines
        n += 1
        name = f"step_{step:06d}.{n}"
    _write(os.path.join(history, f"{name}.yaml"), text)
    return record.lines


def _prepare_run_dir(cfg: MegaOPDConfig) -> list[str]:
    """check_resume then record_config at the planned step (in one go: for tools and tests without ranks)."""
    record = check_resume(cfg)
    step = 0 if cfg.run.start_over else _resume_point(cfg.run.dir)[1]
    return record_config(cfg, record, step)


LOCK = "run.lock"
"""RUN/run.lock: flock'ed for a run's life by the process that starts it (one run per folder); it holds the
holder's host, pid and start time for the refusal's line. The OS drops the lock when that process ends, even by
SIGKILL: a stale file locks nothing."""


class RunDirError(ValueError):
    """run.dir cannot hold this run (in use by another, not a writable folder); the message says which and why."""


def hold_run_dir(run_dir: str) -> int:
    """Creates run_dir if needed and takes its lock (LOCK); returns the lock's file descriptor, to keep open for
    the run's life. Raises RunDirError naming the holder (host, pid, since when) when another run holds it, or
    the problem when run_dir is no writable folder; a refused start writes nothing (a second trainer finds the
    folder and the lock file there already)."""
    path = os.path.join(run_dir, LOCK)
    try:
        os.makedirs(run_dir, exist_ok=True)
        if not os.access(run_dir, os.W_OK):
            raise PermissionError(13, "Permission denied")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        what = "a file, not a folder" if os.path.exists(run_dir) and not os.path.isdir(run_dir) else e.strerror
        raise RunDirError(
            f"run.dir={run_dir} cannot hold the run ({what}): set run.dir to a folder this user can write"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "a process that has not said who"
        os.close(fd)
        raise RunDirError(
            f"run.dir={run_dir} is in use by another megaopd train ({holder}; lock {path}): wait for it to end "
            f"or stop it, or set another run.dir"
        ) from None
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {since}\n".encode(), 0)
    return fd


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _rank_failed(cfg: MegaOPDConfig, rank: int | None, summary: str, details: str) -> int:
    """One line on the terminal; the traceback in RUN/logs/rank_R.err."""
    where = ""
    if details:
        path = os.path.join(cfg.run.dir, "logs", f"rank_{rank}.err")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(details)
            where = f" (traceback: {path})"
        except OSError as e:  # a full disk (the likely cause of the failure itself): the line still goes out
            where = f" (its traceback could not be written to {path}: {e.strerror})"
    who = f"rank {rank}" if rank is not None else "the ranks"
    print(f"megaopd train: {who} failed: {summary}{where}", file=sys.stderr, flush=True)
    return 1


def run_worker(rank: int, world_size: int, cfg: MegaOPDConfig, record: ConfigRecord | None = None) -> RunSummary | None:
    """One rank of `megaopd train` (a spawned worker, or the torchrun / srun process itself).

    The trainer (megatron-core, transformers: ~11 s of imports on a 2-core CPU) is imported here, in the rank,
    not at the top: the process that only launches the ranks would otherwise import it too, before they start.
    The preemption flag comes first: without it a rank under torchrun would ignore the signal (it inherits
    torchrun's ignored USR1) and one spawned here would die of it. Until the trainer is built (imports, data,
    tokenizers, the models' builds and loads: minutes at 7B) a signal also ends the start-up where it is
    (StartupInterrupted, raised by the handler at the next Python instruction): nothing has been trained, so
    nothing needs saving, and a start-up that would run for minutes more (a real tokenizer pair's tables, a
    big model's load) exits within seconds, 0 as a preempted run does. The run folder is left as a SIGKILL
    would leave it, which every write of a start is made to survive (temporary names, then os.replace).
    """
    from megaopd.trainer.preemption import PreemptionFlag

    preemption = PreemptionFlag()

    def during_startup(signum, frame):
        preemption._handle(signum, frame)  # the flag set, later copies of the signal ignored
        raise StartupInterrupted(signum)

    for sig in preemption.signals:
        signal.signal(sig, during_startup)
    try:
        if "GROUP_RANK" in os.environ:  # under torchrun (GROUP_RANK: its node rank): which rank runs on which node
            print(
                f"megaopd train: rank {rank}/{world_size} on {socket.gethostname()} (node rank "
                f"{os.environ['GROUP_RANK']}, local rank {os.environ.get('LOCAL_RANK')})\n",
                end="",  # one write with its newline: the ranks of a node share one stream, whole lines each
                flush=True,
            )
        from megaopd.trainer.trainer import Trainer

        trainer = Trainer(cfg, preemption=preemption)  # the resume has loaded: nothing left to refuse it
        for sig in preemption.signals:  # from here the step loop reads the flag (and saves what it trained)
            if signal.getsignal(sig) is during_startup:
                signal.signal(sig, preemption._handle)
    except StartupInterrupted as e:
        if rank == 0:
            print(
                f"megaopd train: preemption signal {signal.Signals(e.signum).name} during start-up: nothing "
                f"trained since the last checkpoint, nothing to save; exiting",
                file=sys.stderr,
                flush=True,
            )
        from megaopd.trainer.run_log import RunSummary

        return RunSummary(start_step=0, end_step=0, preempted=True) if rank == 0 else None
    if rank == 0 and record is not None:
        for line in record_config(cfg, record, trainer.step):
            print(line, flush=True)
    summary = trainer.train()
    if trainer.run_log is not None:
        trainer.run_log.close()
    return summary if rank == 0 else None


class StartupInterrupted(BaseException):
    """A preemption signal before the trainer was built (run_worker). A BaseException, as KeyboardInterrupt:
    the start-up's own `except Exception` handlers let it through."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


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
    from megaopd.parallel.launch import under_launcher

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
    lock, record = None, None
    if int(os.environ.get("RANK", "0")) == 0:  # the launching process (local workers) or rank 0 (torchrun, srun)
        try:
            lock = hold_run_dir(cfg.run.dir)  # first: a second trainer on this folder stops before any write
            record = check_resume(cfg)
        except (ValueError, FileNotFoundError) as e:
            if lock is not None:
                os.close(lock)
            print(f"megaopd train: {e}", file=sys.stderr)
            return 2
    try:
        return _train(cfg, record)
    finally:
        if lock is not None:
            os.close(lock)


def _train(cfg: MegaOPDConfig, record: ConfigRecord | None) -> int:
    from megaopd.parallel.launch import WorkerError, one_line, run_on_ranks

    try:
        results = run_on_ranks(
            run_worker,
            cfg.run.world_size,
            args=(cfg, record),
            timeout=7 * 24 * 3600,
            forward_signals=(signal.SIGTERM, signal.SIGUSR1),
        )
    except WorkerError as e:  # a spawned rank raised: its traceback came with the error
        return _rank_failed(cfg, e.rank, e.summary, e.details)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - this process is the rank (torchrun / srun, or world size 1);
        # BaseException: torch's CheckpointException is one
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
