"""Which checkpoint of a run folder a (re)started run begins from, and what it moves aside (docs/run_folder.md).

    point = agreed_resume_point(run_dir, start_over)    # collective: rank 0 reads and verifies, all get it
    point.path, point.step, point.notes                 # None/0 for a fresh run; one line per thing worth saying

A step folder counts when its manifest verifies (megaopd.models.manifest). `checkpoints/latest` names the
step to resume; when it is missing, or names a folder that is gone or unfinished, the newest step that
verifies (by the step its manifest records, not by its name) is taken instead, said in one line, and the
pointer is written again. A pointer naming a step that does not verify is an error naming the file and the
newest step that does. Existing steps are never trained over from step 0: run.start_over=true moves them
(and the pointer) to checkpoints/old_<time>/, and nothing here deletes a step.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from megaopd.models.hf_config import InputError
from megaopd.models.manifest import Manifest, ManifestError, read_manifest, verify

LATEST = "latest"
STATE = "trainer_state.json"


class RunFolderError(InputError):
    """The run folder cannot be resumed as it is; the message names the file and what to do."""


@dataclass
class ResumePoint:
    path: str | None = None
    """The step folder to load, or None: start at step 0."""
    step: int = 0
    notes: list[str] = field(default_factory=list)
    """Lines for the console (fallbacks taken, folders moved aside, unverified loads)."""


@dataclass(frozen=True)
class StepFolder:
    name: str
    step: int
    """The step recorded inside (the manifest's; trainer_state.json's for a folder without one)."""
    manifest: Manifest | None


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def step_folders(run_dir: str) -> tuple[list[StepFolder], list[str]]:
    """(folders that record their step, newest first; names of step_* folders that record none: unfinished,
    or damaged beyond reading)."""
    root = checkpoints_dir(run_dir)
    found, unreadable = [], []
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    for name in names:
        path = os.path.join(root, name)
        if not name.startswith("step_") or name.endswith(".tmp") or not os.path.isdir(path):
            continue
        try:
            manifest = read_manifest(path)
            step = manifest.step if manifest is not None else _legacy_step(path)
        except (ManifestError, OSError, ValueError):
            step = manifest = None
        if step is None:
            unreadable.append(name)
        else:
            found.append(StepFolder(name, step, manifest))
    return sorted(found, key=lambda f: f.step, reverse=True), unreadable


def _legacy_step(path: str) -> int | None:
    """The step of a folder an older megaopd wrote (no manifest; trainer_state.json last)."""
    state = os.path.join(path, STATE)
    if not os.path.isfile(state):
        return None
    with open(state) as f:
        return int(json.load(f)["step"])


def check_folder(run_dir: str, folder: StepFolder) -> str | None:
    """None when the folder verifies (every file, optimizer included); else one line naming the file."""
    path = os.path.join(checkpoints_dir(run_dir), folder.name)
    if folder.manifest is None:
        return None  # an older megaopd's: loaded unverified (resume_point says so)
    return verify(path, manifest=folder.manifest)


def agreed_resume_point(run_dir: str, start_over: bool = False) -> ResumePoint:
    """Collective: rank 0 runs resume_point; every rank gets its point, or raises its error (so no rank waits
    in a broadcast for a rank 0 that failed)."""
    from megaopd.parallel.dist import rank0_computes

    def decide():
        try:
            return resume_point(run_dir, start_over)
        except Exception as e:  # noqa: BLE001 - handed to every rank, raised there
            return e

    got = rank0_computes(decide)
    if isinstance(got, Exception):
        raise got
    return got


@dataclass(frozen=True)
class _Choice:
    """The step folder a start resumes from, as `_choose` picks it."""

    folder: StepFolder | None
    """None: the pointer names none and no folder verifies."""
    named: str | None
    """What checkpoints/latest names (None: missing or unreadable)."""
    fell_back: bool
    """The pointer names no folder that records its step: `folder` is the newest that verifies."""
    skipped: list[str]
    """When it fell back: the problems of the newer folders passed over."""


def _choose(run_dir: str, folders: list[StepFolder]) -> _Choice:
    """The one choice of the step to resume: the folder the pointer names (verified by resume_point before it
    is loaded) or, with the pointer missing or stale, the newest folder that verifies (each newer one hashed
    once, here)."""
    named = _pointer(run_dir)
    by_name = {f.name: f for f in folders}
    if named in by_name:
        return _Choice(by_name[named], named, False, [])
    folder, skipped = _newest_verified(run_dir, folders)
    return _Choice(folder, named, True, skipped)


def planned_resume(run_dir: str) -> tuple[str | None, int]:
    """Read-only: the step folder a start would resume from and the step it records ((None, 0): step 0), for
    the checks made before anything is written (`megaopd train`'s config compare). Moves and writes nothing:
    resume_point makes the same choice (_choose), verifies it and says the rest when the ranks start; None when
    no folder verifies (resume_point's error)."""
    folders, _ = step_folders(run_dir)
    chosen = _choose(run_dir, folders).folder
    return (os.path.join(checkpoints_dir(run_dir), chosen.name), chosen.step) if chosen else (None, 0)


def resume_point(run_dir: str, start_over: bool = False) -> ResumePoint:
    """Rank 0's decision (module docstring); moves folders aside, rewrites the pointer, never deletes."""
    folders, unreadable = step_folders(run_dir)
    if start_over:
        return _start_over(run_dir, folders, unreadable)
    if not folders and not unreadable:
        return ResumePoint()
    choice = _choose(run_dir, folders)
    chosen, named = choice.folder, choice.named
    point = ResumePoint()
    if not choice.fell_back:
        problem = check_folder(run_dir, chosen)
        if problem is not None:
            raise RunFolderError(f"{problem}. {_fallback_advice(run_dir, folders, named)}")
    else:
        why = "is missing" if named is None else f"names {named!r}, which is missing or unfinished"
        if chosen is None:
            raise RunFolderError(
                f"{_rel(run_dir, LATEST)} {why} and no step folder verifies "
                f"({'; '.join(choice.skipped + unreadable)[:600]}); restore the files, or set "
                f"run.start_over=true (the old steps are moved to checkpoints/old_<time>/)"
            )
        point.notes.append(
            f"{_rel(run_dir, LATEST)} {why}: resuming from the newest complete step, "
            f"{_rel(run_dir, chosen.name)} (step {chosen.step})"
        )
    point.path, point.step = os.path.join(checkpoints_dir(run_dir), chosen.name), chosen.step
    if chosen.manifest is None:
        point.notes.append(
            f"{point.path} has no manifest (an older megaopd wrote it): resuming from it "
            f"unverified, its pickles through the restricted reader"
        )
    newer = [f.name for f in folders if f.step > chosen.step] + unreadable
    if newer:
        aside = _move_aside(run_dir, newer)
        point.notes.append(f"moved {', '.join(newer)} (newer than step {chosen.step} but not verified) to {aside}")
    _write_pointer(run_dir, chosen.name)
    return point


def _newest_verified(run_dir: str, folders: list[StepFolder]) -> tuple[StepFolder | None, list[str]]:
    skipped = []
    for folder in folders:
        problem = check_folder(run_dir, folder)
        if problem is None:
            return folder, skipped
        skipped.append(problem)
    return None, skipped


def _fallback_advice(run_dir: str, folders: list[StepFolder], bad: str) -> str:
    older, _ = _newest_verified(run_dir, [f for f in folders if f.name != bad])
    if older is None:
        return (
            "No other step verifies: restore the file, or set run.start_over=true (the old steps are moved "
            "to checkpoints/old_<time>/)"
        )
    return (
        f"The newest step that verifies is {_rel(run_dir, older.name)} (step {older.step}): restore the file, "
        f"or resume from it by writing {older.name} into {_rel(run_dir, LATEST)} (the newer steps are then "
        f"moved aside, not deleted)"
    )


def _start_over(run_dir: str, folders: list[StepFolder], unreadable: list[str]) -> ResumePoint:
    names = [f.name for f in folders] + unreadable
    if os.path.exists(os.path.join(checkpoints_dir(run_dir), LATEST)):
        names.append(LATEST)
    if not names:
        return ResumePoint()
    aside = _move_aside(run_dir, names)
    return ResumePoint(notes=[f"run.start_over: moved {len(names)} checkpoint entries to {aside}; starting at step 0"])


def _pointer(run_dir: str) -> str | None:
    path = os.path.join(checkpoints_dir(run_dir), LATEST)
    try:
        with open(path) as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if name.startswith("step_") and "/" not in name else None


def _write_pointer(run_dir: str, name: str) -> None:
    tmp = os.path.join(checkpoints_dir(run_dir), LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(name)
    os.replace(tmp, os.path.join(checkpoints_dir(run_dir), LATEST))


def _move_aside(run_dir: str, names: list[str]) -> str:
    """Moves checkpoints/NAME for each name into a new checkpoints/old_<time>/; returns that folder."""
    root = checkpoints_dir(run_dir)
    aside = os.path.join(root, time.strftime("old_%Y%m%d_%H%M%S", time.gmtime()))
    while os.path.exists(aside):
        aside += "_"
    os.makedirs(aside)
    for name in names:
        os.replace(os.path.join(root, name), os.path.join(aside, name))
    return aside


def _rel(run_dir: str, name: str) -> str:
    return os.path.join(checkpoints_dir(run_dir), name)
