"""Reading and writing row files (.jsonl/.json and .parquet) without ever crashing on a bad row.

    for loc, row in iter_rows(["data/train-00000-of-00010.parquet"]):   # loc = "file:row", row = dict | str
        ...

A row that cannot be read comes out as a string (the reason) instead of a dict, so the caller skips and
counts it. Parquet goes through `datasets` in streaming mode: OpenR1-Math-220k's default split is ~5 GB of
parquet, streaming reads it shard by shard without an Arrow cache copy on disk. JSON lines are parsed one
line at a time so that one broken line costs one row, not the file.
"""

from __future__ import annotations

import json
import os
from typing import Iterator, Sequence, Union

Row = Union[dict, str]


def _iter_jsonl(path: str) -> Iterator[tuple[str, Row]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            loc = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield loc, f"invalid json ({e.msg})"
                continue
            yield loc, row if isinstance(row, dict) else "row is not a json object"


def _iter_json(path: str) -> Iterator[tuple[str, Row]]:
    """A .json file: one array of row objects, or JSON lines saved under a .json name."""
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(1 << 16).lstrip()
    if not head.startswith("["):
        yield from _iter_jsonl(path)
        return
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            rows = json.load(f)
    except json.JSONDecodeError as e:
        yield f"{path}:0", f"invalid json file ({e.msg} at line {e.lineno})"
        return
    for i, row in enumerate(rows):
        yield f"{path}:{i}", row if isinstance(row, dict) else "row is not a json object"


def _iter_parquet(path: str) -> Iterator[tuple[str, Row]]:
    import datasets  # imported here: a jsonl-only job should not pay for it

    try:
        stream = datasets.load_dataset("parquet", data_files=[path], split="train", streaming=True)
        for i, row in enumerate(stream):
            yield f"{path}:{i}", row
    except Exception as e:  # a corrupt or non-parquet file: one counted failure, the other files still load
        yield f"{path}:?", f"unreadable parquet file ({type(e).__name__}: {str(e).splitlines()[0][:200]})"


def iter_rows(files: Sequence[str]) -> Iterator[tuple[str, Row]]:
    """(location, row) over all files in order; row is a dict, or a string naming why it is unusable."""
    for path in files:
        if path.endswith(".parquet"):
            yield from _iter_parquet(path)
        elif path.endswith(".json"):
            yield from _iter_json(path)
        elif path.endswith(".jsonl"):
            yield from _iter_jsonl(path)
        else:
            yield f"{path}:0", "unsupported file type (use .jsonl, .json or .parquet)"


def write_rows(path: str, rows: Sequence[dict]) -> None:
    """Writes rows to .jsonl (one sorted-key-free JSON object per line, UTF-8) or .parquet; byte-stable."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    if path.endswith(".jsonl"):
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    elif path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), tmp, compression="zstd")
    else:
        raise ValueError(f"cannot write {path!r}: use a .jsonl or .parquet file name")
    os.replace(tmp, path)  # a killed writer leaves no half-written file under the real name
