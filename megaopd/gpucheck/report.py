"""The check table: one Row per measured quantity, PASS/FAIL against its bound, printed as markdown."""

from __future__ import annotations

import math
import os
import traceback
from dataclasses import dataclass, field


@dataclass
class Row:
    """One line of the table."""

    part: str
    """a (ops/losses), b (HF vs megatron), c (trainer), d (TP=2), bench."""
    check: str
    dtype: str
    metric: str
    value: float | str
    bound: str
    """"<= 1e-4", "== 6", "" (information only)."""
    status: str
    """PASS | FAIL | INFO | SKIP."""


@dataclass
class Table:
    rows: list[Row] = field(default_factory=list)

    def le(self, part: str, check: str, dtype: str, metric: str, value: float, bound: float) -> bool:
        """A PASS row when value <= bound (a NaN value fails)."""
        ok = value is not None and not math.isnan(value) and value <= bound
        self.rows.append(Row(part, check, dtype, metric, value, f"<= {bound:.3g}", "PASS" if ok else "FAIL"))
        return ok

    def eq(self, part: str, check: str, dtype: str, metric: str, value, want) -> bool:
        ok = value == want
        self.rows.append(Row(part, check, dtype, metric, value, f"== {want}", "PASS" if ok else "FAIL"))
        return ok

    def info(self, part: str, check: str, dtype: str, metric: str, value) -> None:
        self.rows.append(Row(part, check, dtype, metric, value, "", "INFO"))

    def skip(self, part: str, check: str, why: str) -> None:
        self.rows.append(Row(part, check, "-", why, "-", "", "SKIP"))

    def fail(self, part: str, check: str, dtype: str, why: str) -> None:
        self.rows.append(Row(part, check, dtype, why, "-", "", "FAIL"))

    def guard(self, part: str, check: str, dtype: str = "-"):
        """Context manager: an exception inside becomes one FAIL row (with its last line) and the traceback
        goes to stderr, so one broken part does not hide the others' results."""
        table = self

        class _Guard:
            def __enter__(self):
                return table

            def __exit__(self, et, ev, tb):
                if et is None:
                    return False
                if issubclass(et, KeyboardInterrupt):
                    return False
                traceback.print_exception(et, ev, tb)
                msg = " ".join(f"{et.__name__}: {ev}".split())
                table.fail(part, check, dtype, msg[:300])
                return True

        return _Guard()

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.status == "FAIL"]

    def markdown(self, title: str = "") -> str:
        lines = [f"## {title}", ""] if title else []
        lines += [
            "| part | check | dtype | metric | value | bound | result |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in self.rows:
            lines.append(
                f"| {r.part} | {r.check} | {r.dtype} | {_cell(r.metric)} | {_fmt(r.value)} | {r.bound} | {r.status} |"
            )
        n = {s: sum(r.status == s for r in self.rows) for s in ("PASS", "FAIL", "INFO", "SKIP")}
        lines += ["", f"{n['PASS']} passed, {n['FAIL']} failed, {n['INFO']} info, {n['SKIP']} skipped"]
        return "\n".join(lines) + "\n"

    def write(self, text: str, name: str = "gpu_check.md") -> str | None:
        """Writes text to $OUT/name when OUT is set (the device machine's folder that comes back)."""
        out = os.environ.get("OUT")
        if not out:
            return None
        path = os.path.join(out, name)
        with open(path, "w") as f:
            f.write(text)
        return path


def _fmt(v) -> str:
    if isinstance(v, bool) or not isinstance(v, float):
        return _cell(str(v))
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.3e}"


def _cell(s: str) -> str:
    return str(s).replace("|", "/").replace("\n", " ")


def max_rel(got, want) -> float:
    """max |got - want| / max |want| (both moved to float64 on the CPU): one number per tensor pair."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        raise ValueError(f"shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    if not bool(got.isfinite().all()):
        return float("nan")
    scale = float(want.abs().max()) if want.numel() else 0.0
    return float((got - want).abs().max()) / max(scale, 1e-30) if want.numel() else 0.0


def max_abs(got, want) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if not bool(got.isfinite().all()):
        return float("nan")
    return float((got - want).abs().max())
