"""Verifiable math reward with math-verify: 1.0 when the response's last \\boxed{} answer equals the gold
answer, else 0.0. Never raises; bounded in time.

    R(y, gold) = 1.0  if verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + last_boxed(y) + "}"))
                 0.0  otherwise (no \\boxed{}, unparsable, wrong, timed out, any error)

Departures from calling math_verify.parse on the whole response:
- We extract the last \\boxed{...} ourselves (linear brace matching) and hand math-verify only that,
  so a 30k-character response costs one small parse, and "the final answer" means the last box, as in
  the paper's evaluation. A response without a box is wrong, even when its text ends with a number.
- Timeouts. math-verify guards parse/verify with signal.alarm (whole seconds, main thread only; off the
  main thread it raises "signal only works in main thread"), and its alarm(0) cancels any alarm set by
  the caller (pytest-timeout, a trainer watchdog). We call it with its own timeouts off and wrap the
  whole parse+verify in one guard:
    * main thread: an ITIMER_REAL timer (fractional seconds) that raises a private BaseException (so
      math-verify's `except Exception` cannot swallow it); the caller's timer and handler are restored,
      its remaining time reduced by what we used.
    * other threads (a rollout worker thread, a server handler): one spawned helper process, which runs
      the same guarded call on its own main thread; if it does not answer within timeout + grace it is
      killed and replaced, and the answer scores 0.0. `off_main_thread="no_timeout"` skips the helper.

    from megaopd.metrics.reward import math_verify_reward
    math_verify_reward("... so the answer is \\boxed{\\frac{1}{2}}.", "0.5")   # -> 1.0
"""
from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Sequence

_BOX_COMMANDS = ("\\boxed", "\\fbox")


@dataclass
class RewardConfig:
    """How answers are extracted and verified."""

    timeout_s: float = 5.0
    """Wall-clock budget for parsing and verifying one answer; past it the answer scores 0.0."""
    max_answer_chars: int = 1000
    """A boxed answer longer than this is scored 0.0 without parsing (degenerate output; sympy could
    spend seconds on it)."""
    off_main_thread: Literal["worker", "no_timeout"] = "worker"
    """Off the main thread signals are unavailable: "worker" verifies in a helper process with a hard
    timeout; "no_timeout" calls math-verify directly in the thread (only bounded by max_answer_chars)."""

    def __post_init__(self):
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be positive (seconds per answer)")
        if self.max_answer_chars < 1:
            raise ValueError(f"max_answer_chars={self.max_answer_chars} must be at least 1")
        if self.off_main_thread not in ("worker", "no_timeout"):
            raise ValueError(f"off_main_thread={self.off_main_thread!r}: choose 'worker' or 'no_timeout'")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}, or the `\\boxed 5` form) in text; None if none closes.

    Braces are matched, so nested groups (\\boxed{\\frac{1}{2}}) come back whole. An unclosed last box
    (a truncated response) gives None: the response never stated a final answer.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if i < len(text) and text[i] == " ":
        # "\boxed 5": the argument runs to the next whitespace or "$".
        j = i + 1
        while j < len(text) and not text[j].isspace() and text[j] != "$":
            j += 1
        return text[i + 1 : j] or None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _normalize_gold(gold: str) -> str:
    """A gold answer as a box's content: its own last box if it has one (a full solution), $...$ stripped."""
    gold = str(gold).strip()
    boxed = last_boxed(gold)
    if boxed is not None:
        return boxed
    if len(gold) >= 2 and gold.startswith("$") and gold.endswith("$"):
        gold = gold.strip("$").strip()
    return gold


class _Timeout(BaseException):
    """Raised by our timer; a BaseException so that math-verify's `except Exception` lets it through."""


@contextmanager
def _time_limit(seconds: float):
    """Raise _Timeout in the main thread after `seconds`; restores the caller's SIGALRM handler and timer."""
    def on_alarm(signum, frame):
        raise _Timeout()

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:
            # The caller's timer keeps its deadline; if it passed while we ran, it fires right away.
            remaining = old_delay - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-3), old_interval)


class _DropTimeoutDisabledWarning(logging.Filter):
    # math-verify warns once that its timeout is off; we run it with ours, so the warning misleads.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_mv = None


def _math_verify():
    """Imports math_verify once (sympy + antlr take ~1 s) and silences its timeout-disabled warning."""
    global _mv
    if _mv is None:
        import math_verify

        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
        _mv = math_verify
    return _mv


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold_content: str):
    # avg@32 verifies 32 responses against one gold: parse it once.
    return _math_verify().parse("\\boxed{" + gold_content + "}", parsing_timeout=None)


def _verify_unguarded(answer: str, gold_content: str) -> bool:
    mv = _math_verify()
    gold = _parse_gold(gold_content)
    pred = mv.parse("\\boxed{" + answer + "}", parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(mv.verify(gold, pred, timeout_seconds=None))


def _verify_in_main_thread(answer: str, gold_content: str, timeout_s: float) -> float:
    try:
        with _time_limit(timeout_s):
            return 1.0 if _verify_unguarded(answer, gold_content) else 0.0
    except _Timeout:
        logging.getLogger(__name__).warning("math-verify timed out after %.1fs on answer %.80r", timeout_s, answer)
        return 0.0
    except Exception:  # noqa: BLE001 - a reward never raises: malformed input scores 0
        return 0.0


def _worker_loop(conn) -> None:
    """Helper process body: answers (answer, gold, timeout) requests on its own main thread."""
    while True:
        try:
            req = conn.recv()
        except EOFError:
            return
        if req is None:
            return
        conn.send(_verify_in_main_thread(*req))


class _VerifyWorker:
    """One spawned helper process (spawn, not fork: the parent may hold torch threads and locks)."""

    GRACE_S = 2.0

    def __init__(self):
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None
        self._warm = False
        """The helper has answered once, so its imports are done."""

    def _start(self):
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_loop, args=(child,), daemon=True, name="megaopd-math-verify")
        self._proc.start()
        child.close()
        self._conn = parent

    def _kill(self):
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
        self._proc, self._conn = None, None

    def __call__(self, answer: str, gold_content: str, timeout_s: float) -> float:
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            try:
                self._conn.send((answer, gold_content, timeout_s))
                # The first request also pays the helper's imports (a few seconds).
                startup_s = 0.0 if self._warm else 30.0
                if self._conn.poll(timeout_s + self.GRACE_S + startup_s):
                    self._warm = True
                    return float(self._conn.recv())
            except (EOFError, OSError, BrokenPipeError):
                pass
            self._kill()
            self._warm = False
            return 0.0


_worker = _VerifyWorker()


def math_verify_reward(response: str, gold: str, cfg: RewardConfig | None = None) -> float:
    """1.0 when the last \\boxed{} of `response` verifies against `gold` (a bare answer, $answer$, or a
    solution with a box), else 0.0. Never raises."""
    cfg = cfg or RewardConfig()
    try:
        answer = last_boxed(response)
        if answer is None or not answer.strip() or len(answer) > cfg.max_answer_chars:
            return 0.0
        gold_content = _normalize_gold(gold)
        if not gold_content:
            return 0.0
        if threading.current_thread() is threading.main_thread():
            return _verify_in_main_thread(answer, gold_content, cfg.timeout_s)
        if cfg.off_main_thread == "worker":
            return _worker(answer, gold_content, cfg.timeout_s)
        return 1.0 if _verify_unguarded(answer, gold_content) else 0.0
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return 0.0


def math_verify_rewards(responses: Sequence[str], golds: Sequence[str], cfg: RewardConfig | None = None) -> list[float]:
    """`math_verify_reward` of each (response, gold) pair."""
    if len(responses) != len(golds):
        raise ValueError(f"{len(responses)} responses but {len(golds)} gold answers: pass one gold per response")
    return [math_verify_reward(r, g, cfg) for r, g in zip(responses, golds)]
