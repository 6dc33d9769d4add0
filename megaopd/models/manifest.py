"""A checkpoint's manifest: every file's relative path, size and sha256, and the step, in CKPT/manifest.json.

    records = hash_files(ckpt_dir, list_files(ckpt_dir))
    write_manifest(ckpt_dir, records, step=10)            # LAST, atomically: tmp + os.replace
    problem = verify(ckpt_dir)                            # None, or one line naming the file that differs

The manifest is written after every other file of the checkpoint and renamed into place, so its presence
says the checkpoint was finished, and its hashes say the files are the ones written: a flipped byte, a
truncated shard, a lost or an added file is found before a byte of state is read (docs/run_folder.md).
A directory without manifest.json (an older megaopd, or a checkpoint from elsewhere) is "unverified":
the caller decides what that means (megaopd loads it, through the restricted reader of safe_load).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from megaopd.models.hf_config import InputError

MANIFEST = "manifest.json"
FORMAT = "megaopd-manifest"
_CHUNK = 8 << 20
# Top-level names written next to a checkpoint's state, not part of it: `megaopd eval --ckpt` writes its
# results into CKPT/eval/ by default. Neither listed nor verified.
NOT_STATE = ("eval",)


class ManifestError(InputError):
    """A checkpoint whose files are not the ones its manifest lists; the message names the file."""


@dataclass(frozen=True)
class FileRecord:
    path: str
    """Relative to the checkpoint directory, '/'-separated."""
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int | None
    """The training step the checkpoint holds (None for a model checkpoint that is no training step)."""
    files: tuple[FileRecord, ...]


def list_files(root: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The checkpoint's files (relative, sorted), without the manifest itself; `skip`: top-level names (files
    or folders) left out, e.g. ("optimizer", "rng") when only the model is read."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}"
            if rel == MANIFEST or rel == MANIFEST + ".tmp":
                continue
            if rel.split("/")[0] in skip or rel.split("/")[0] in NOT_STATE:
                continue
            out.append(rel)
    return sorted(out)


def hash_file(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def hash_files(root: str, paths: list[str]) -> list[FileRecord]:
    """Records of `paths` (relative to root), hashed on up to 4 threads: hashlib releases the GIL on large
    updates, so a rank's shards hash in parallel where cores are free."""
    from concurrent.futures import ThreadPoolExecutor

    if len(paths) <= 1:
        return [FileRecord(p, *hash_file(os.path.join(root, p))) for p in paths]
    with ThreadPoolExecutor(max_workers=min(4, len(paths), os.cpu_count() or 1)) as pool:
        sums = list(pool.map(lambda p: hash_file(os.path.join(root, p)), paths))
    return [FileRecord(p, *s) for p, s in zip(paths, sums)]


def write_manifest(root: str, records: list[FileRecord], step: int | None) -> str:
    """Writes root/manifest.json atomically (after every file it lists: the caller's job)."""
    body = {
        "format": FORMAT,
        "version": 1,
        "step": step,
        "files": {r.path: {"size": r.size, "sha256": r.sha256} for r in sorted(records, key=lambda r: r.path)},
    }
    path = os.path.join(root, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())  # the rename must not land before the bytes (a crash would leave an empty manifest)
    os.replace(path + ".tmp", path)
    return path


def read_manifest(root: str) -> Manifest | None:
    """The manifest, or None when the directory has none; a manifest that is not one raises ManifestError."""
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            body = json.load(f)
        if body.get("format") != FORMAT:
            raise ValueError(f"format {body.get('format')!r}")
        files = tuple(FileRecord(p, int(v["size"]), str(v["sha256"])) for p, v in body["files"].items())
        step = body.get("step")
        return Manifest(int(step) if step is not None else None, files)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ManifestError(
            f"{path} is not a readable megaopd manifest ({e}); the checkpoint cannot be "
            f"verified: use an earlier checkpoint"
        ) from None


def verify(root: str, skip: tuple[str, ...] = (), manifest: Manifest | None = None) -> str | None:
    """None when every file (but those under the top-level names `skip`) has its manifest's size and hash
    and no other file is there; else one line naming the first file that differs. The directory must have
    a manifest (read_manifest first to tell an unverified checkpoint apart)."""
    manifest = manifest or read_manifest(root)
    if manifest is None:
        return f"{root} has no {MANIFEST}"
    listed = {r.path: r for r in manifest.files if r.path.split("/")[0] not in skip + NOT_STATE}
    present = list_files(root, skip)
    for rel in sorted(set(listed) - set(present)):
        return f"{os.path.join(root, rel)} is missing (its {MANIFEST} lists it)"
    for rel in present:
        if rel not in listed:
            return f"{os.path.join(root, rel)} is not in its {MANIFEST} (a file added after the save)"
    for rel in present:  # sizes first: a truncated file is named without hashing the rest
        size = os.path.getsize(os.path.join(root, rel))
        if size != listed[rel].size:
            return (
                f"{os.path.join(root, rel)} is {size} bytes, its {MANIFEST} says {listed[rel].size} "
                f"(truncated or overwritten)"
            )
    for record in hash_files(root, present):
        rel, digest = record.path, record.sha256
        if digest != listed[rel].sha256:
            return (
                f"{os.path.join(root, rel)} differs from its {MANIFEST} (sha256 {digest[:12]}..., "
                f"recorded {listed[rel].sha256[:12]}...): the file is corrupted or was changed"
            )
    return None
