"""OUT/generations.jsonl: every scored sample of an evaluation, appended as samples complete, so that a
killed evaluation started again generates only what is missing.

One line per sample (GenerationRecord): which benchmark, problem (index and id) and sample it is, the
response, the verdict (and the extraction it was made with) and the health flags the tables are computed
from. A record appended later for the same sample replaces the earlier one (a re-scored verdict). Beside it,
OUT/generation_config.json holds the settings that decide what a sample is (temperature, top_p, token
budget, seed, chat template); a restart with other settings is refused with one clear error instead of
mixing two evaluations in one table.

Crash safety: each batch of records is written with one write() and flushed; a kill can at worst leave a
torn last line, which the next start cuts off (that sample is generated again, nothing else is).
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Iterable

GENERATIONS_FILE = "generations.jsonl"
CONFIG_FILE = "generation_config.json"


@dataclass
class GenerationRecord:
    """One generated, scored response."""

    benchmark: str
    index: int
    """Position of the problem in the benchmark file (with the sample number, the record's key)."""
    id: str
    sample: int
    samples: int
    """Samples per problem of this evaluation (k of avg@k); part of the seed, so it must not change on resume."""
    problem: str
    answer: str
    response: str
    extracted: str | None
    correct: bool
    finish_reason: str
    response_tokens: int
    repetitive: bool
    extract: str = "boxed"
    """The extraction `extracted` and `correct` were made with (RewardConfig.extract); records written before
    this field were boxed. A rerun with another extraction re-scores the record instead of generating it."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GenerationRecord":
        names = {f.name for f in fields(cls)}
        missing = {f.name for f in fields(cls) if f.default is MISSING} - set(d)
        if missing:
            raise ValueError(f"record lacks {sorted(missing)}")
        return cls(**{k: d[k] for k in names if k in d})


class GenerationStore:
    """Reads what an earlier (killed) run of the same evaluation left in out_dir and appends new records.

    store = GenerationStore(out_dir, settings)      # raises ValueError if out_dir holds another evaluation
    done = store.done("aime24")                     # {(index, sample): GenerationRecord}
    store.append(records)                           # one write + flush
    """

    def __init__(self, out_dir: str, settings: dict[str, Any]):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, GENERATIONS_FILE)
        self._check_settings(os.path.join(out_dir, CONFIG_FILE), settings)
        self._records: dict[str, dict[tuple[int, int], GenerationRecord]] = {}
        self._load()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _check_settings(self, path: str, settings: dict[str, Any]) -> None:
        if os.path.exists(path) and os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            with open(path) as f:
                before = json.load(f)
            changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
            if changed:
                desc = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
                raise ValueError(
                    f"{self.path} holds generations of an evaluation with other settings ({desc}); "
                    f"evaluate into another --out folder, or delete {self.path} to start over"
                )
        with open(path, "w") as f:
            json.dump(settings, f, indent=2)

    def _load(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path, "rb") as f:
            data = f.read()
        good = data.rfind(b"\n") + 1  # a torn last line (killed mid-write) is cut off
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
        for n, line in enumerate(data[:good].decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = GenerationRecord.from_dict(json.loads(line))
            except (json.JSONDecodeError, ValueError, TypeError) as e:
                raise ValueError(
                    f"{self.path} line {n} is not a generation record ({e}): delete the file to "
                    "start the evaluation over"
                ) from e
            self._records.setdefault(rec.benchmark, {})[(rec.index, rec.sample)] = rec

    def done(self, benchmark: str) -> dict[tuple[int, int], GenerationRecord]:
        return self._records.get(benchmark, {})

    def append(self, records: Iterable[GenerationRecord]) -> None:
        records = list(records)
        if not records:
            return
        data = "".join(r.to_json() + "\n" for r in records).encode("utf-8")
        while data:  # regular files take it in one write; loop in case of a short one
            data = data[os.write(self._fd, data) :]
        os.fsync(self._fd)
        for r in records:
            self._records.setdefault(r.benchmark, {})[(r.index, r.sample)] = r

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
