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


NON_UTF8 = ("refuse", "skip")
"""What a row file's bytes that are not UTF-8 do (data.non_utf8): refuse, the load stops in one line naming the
file, the line and the byte (the default: such bytes are a damaged file or another encoding, and replacing them
with U+FFFD would train on text nobody wrote); skip, the line is one counted unusable row of the load report.
Never replaced silently."""


class NonUtf8Error(ValueError):
    """A row file holds bytes that are not UTF-8 (data.non_utf8=refuse); the message names the file and line."""


def _decoded(path: str, lineno: int, raw: bytes, non_utf8: str) -> str | None:
    """The line as text; None (skip) or NonUtf8Error (refuse) when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"{path}:{lineno}: byte 0x{raw[e.start]:02x} at column {e.start + 1} is not UTF-8"
        if non_utf8 == "skip":
            return None
        raise NonUtf8Error(
            f"{where}: convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8), or set data.non_utf8=skip to "
            f"count such lines as unusable rows"
        ) from None


def _iter_jsonl(path: str, non_utf8: str = "refuse") -> Iterator[tuple[str, Row]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            loc = f"{path}:{lineno}"
            line = _decoded(path, lineno, raw, non_utf8)
            if line is None:
                yield loc, "not UTF-8"
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield loc, f"invalid json ({e.msg})"
                continue
            yield loc, row if isinstance(row, dict) else "row is not a json object"


def _iter_json(path: str, non_utf8: str = "refuse") -> Iterator[tuple[str, Row]]:
    """A .json file: one array of row objects, or JSON lines saved under a .json name."""
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(1 << 16).lstrip()
    if not head.startswith("["):
        yield from _iter_jsonl(path, non_utf8)
        return
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        # the line holding the first bad byte (a UTF-8 sequence never spans a newline: that line fails alone)
        lineno = data.count(b"\n", 0, e.start) + 1
        _decoded(path, lineno, data.split(b"\n")[lineno - 1], non_utf8)  # raises when refused
        yield f"{path}:{lineno}", "not UTF-8 (the whole .json array)"
        return
    try:
        rows = json.loads(text)
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


def iter_rows(files: Sequence[str], non_utf8: str = "refuse") -> Iterator[tuple[str, Row]]:
    """(location, row) over all files in order; row is a dict, or a string naming why it is unusable.
    non_utf8: NON_UTF8 (refuse raises NonUtf8Error naming the file and line)."""
    if non_utf8 not in NON_UTF8:
        raise ValueError(f"non_utf8={non_utf8!r}: choose refuse or skip")
    for path in files:
        if path.endswith(".parquet"):
            yield from _iter_parquet(path)
        elif path.endswith(".json"):
            yield from _iter_json(path, non_utf8)
        elif path.endswith(".jsonl"):
            yield from _iter_jsonl(path, non_utf8)
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
