"""Verifiable math reward with math-verify: 1.0 when the answer extracted from the response equals the gold
answer, else 0.0. Never raises; bounded in time.

    R(y, gold) = 1.0  if verify(parse("\\boxed{" + gold + "}"), extract(y))
                 0.0  otherwise (no answer found, unparsable, wrong, timed out, any error)

How the answer is extracted is one setting, RewardConfig.extract, read by the rewards, validation and
`megaopd eval` alike (EXTRACTIONS):
    boxed      the content of the last \\boxed{...} (the paper's rule, every preset's): we extract it
               ourselves (linear brace matching) and hand math-verify only that, so a 30k-character
               response costs one small parse. A response without a box is wrong, even when it ends with
               the right number.
    latex      math-verify's LaTeX target: an anchored answer ("final answer is $x$", "answer: $x$"),
               else a \\boxed{}, else the last LaTeX expression ($...$, \\[...\\], \\(...\\), \\frac{a}{b}).
    number     math-verify's expression target: a number after "answer" ("The answer is 42."), else the
               last plain number or arithmetic expression ("... so 3 + 4 = 7 apples." -> 7). For models that
               do not box (SmolLM2-135M-Instruct never does).
    answer_is  only anchored answers: "the (final) answer is ...", "answer: ..." (LaTeX or a number).
    any        math-verify's own default: the LaTeX and expression targets together, by its priorities.
Every mode but boxed hands math-verify the whole response (its regexes find the answer), so it costs more
per response; the bounds below apply the same.

- Time and memory bounds. math-verify guards parse/verify with signal.alarm (whole seconds, main thread
  only; elsewhere it raises "signal only works in main thread"), its alarm(0) cancels any alarm the
  caller set (pytest-timeout, a watchdog), and no signal interrupts one long C-level call: sympy's evalf
  of "\\boxed{10^{10^{10^{10^{10}}}}}" ran 27 s past a 2 s alarm inside mpmath's integer power. So we call
  math-verify with its own timeouts off and bound the call ourselves (RewardConfig.isolation):
    * "process" (default): a helper Python process (started once, `python -c`, so no re-import of the
      caller's __main__) answers one request per line over pipes; past timeout_s + grace it is killed and
      restarted and the answer scores 0.0; its address space is capped (worker_memory_mb). Pipe overhead
      is well under a millisecond against ~10 ms per verification.
    * "signal": in-process, an ITIMER_REAL timer (fractional seconds) on the main thread raising a private
      BaseException (math-verify's `except Exception` cannot swallow it); the caller's timer and handler are
      restored. Cheaper, but a long C call overruns it. Off the main thread it uses the helper process.
    * "none": no bound besides max_answer_chars.

    from megaopd.metrics.reward import RewardConfig, extract_and_verify, math_verify_reward
    math_verify_reward("... so the answer is \\boxed{\\frac{1}{2}}.", "0.5")   # -> 1.0
    extract_and_verify("The answer is 42.", "42", RewardConfig(extract="number"))  # -> Verdict(True, "42")
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

_BOX_COMMANDS = ("\\boxed", "\\fbox")

EXTRACTIONS = {
    "boxed": "a \\boxed{} answer",
    "latex": "a LaTeX answer",
    "number": "a number",
    "answer_is": 'an "answer is ..." statement',
    "any": "an answer math-verify could extract",
}
"""RewardConfig.extract's modes (module docstring), each with what it looks for, as the found-count
warning names it."""

FEW_ANSWERS = 0.1
"""Below this share of responses with an extractable answer, validation and `megaopd eval` warn: the
accuracy then measures the extraction, not the model (a model that never boxes reads 0.0 under boxed)."""


@dataclass
class RewardConfig:
    """How answers are extracted and verified (job config: metrics.reward; `megaopd eval --extract`)."""

    extract: str = "boxed"
    """Where the answer is read from a response (module docstring): boxed (the last \\boxed{}, the paper's
    rule and every preset's), latex, number, answer_is or any. One setting for the rollouts' rewards,
    validation and `megaopd eval`."""
    timeout_s: float = 5.0
    """Wall-clock budget for parsing and verifying one answer; past it the answer scores 0.0."""
    max_answer_chars: int = 1000
    """An extracted answer longer than this is scored 0.0 without verifying it (degenerate output; sympy
    could spend seconds on it)."""
    isolation: str = "process"
    """How the timeout is enforced (module docstring): "process" = helper process, hard time and memory
    bounds; "signal" = in-process timer on the main thread (a long C-level call can overrun it);
    "none" = unbounded."""
    worker_memory_mb: int = 4096
    """Address-space cap of the helper process beyond what it has mapped after its imports; a verification
    that needs more fails with MemoryError and scores 0.0."""

    def __post_init__(self):
        if self.extract not in EXTRACTIONS:
            raise ValueError(
                f"metrics.reward.extract={self.extract!r}: choose one of {', '.join(EXTRACTIONS)} "
                f"(boxed: the last \\boxed{{}}; number: for models that do not box their answers)"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be positive (seconds per answer)")
        if self.max_answer_chars < 1:
            raise ValueError(f"max_answer_chars={self.max_answer_chars} must be at least 1")
        if self.isolation not in ("process", "signal", "none"):
            raise ValueError(f"isolation={self.isolation!r}: choose process, signal or none")
        if self.worker_memory_mb < 256:
            raise ValueError(f"worker_memory_mb={self.worker_memory_mb} is too small for sympy (>= 256)")


@dataclass
class Verdict:
    """One response scored: was it right, and what was read as its answer."""

    correct: bool
    extracted: str | None
    """The answer as extracted (a box's content, or the text math-verify matched); None when the response
    has none (or its extraction timed out)."""

    @property
    def found(self) -> bool:
        """The response had an extractable answer (right or wrong)."""
        return bool(self.extracted and self.extracted.strip())


def few_answers_warning(found: int, total: int, extract: str, set_hint: str) -> str | None:
    """One line when fewer than FEW_ANSWERS of `total` responses had an answer under `extract`, naming how
    to switch (set_hint: "metrics.reward.extract=" or "--extract "); None otherwise."""
    if total <= 0 or found >= FEW_ANSWERS * total:
        return None
    return (
        f"{found} of {total} responses had {EXTRACTIONS[extract]} (extract={extract}), so accuracy measures "
        f"the extraction, not the model: set {set_hint}number (or latex, answer_is, any) for a model that "
        f"does not {'box its answers' if extract == 'boxed' else 'answer that way'}"
    )


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


@functools.lru_cache(maxsize=None)
def _targets(extract: str) -> tuple:
    """math-verify's extraction targets of a RewardConfig.extract mode other than boxed."""
    mv = _math_verify()
    latex, expr = mv.LatexExtractionConfig, mv.ExprExtractionConfig
    return {
        "latex": (latex(),),
        "number": (expr(),),
        # Without their anchor-free patterns both targets match only after "answer"; no bare boxes either.
        "answer_is": (
            latex(try_extract_without_anchor=False, boxed_match_priority=-1),
            expr(try_extract_without_anchor=False),
        ),
        "any": (latex(), expr()),
    }[extract]


def _extract(mv, text: str, extract: str, max_chars: int) -> tuple[list, str | None]:
    """(math-verify's parse of the answer, the answer's text). boxed: `text` is the box's content already."""
    if extract == "boxed":
        return mv.parse("\\boxed{" + text + "}", parsing_timeout=None), text
    pred = mv.parse(text, extraction_config=_targets(extract), parsing_timeout=None)
    # parse() returns [sympy value, matched text], or [matched text] when the match did not parse.
    extracted = next((p for p in pred if isinstance(p, str)), str(pred[0]) if pred else None)
    if extracted is not None and len(extracted) > max_chars:
        return [], extracted
    return pred, extracted


def _verify_unguarded(text: str, gold_content: str, extract: str = "boxed", max_chars: int = 1000) -> Verdict:
    mv = _math_verify()
    pred, extracted = _extract(mv, text, extract, max_chars)
    gold = _parse_gold(gold_content)
    if not gold or not pred:
        return Verdict(False, extracted)
    return Verdict(bool(mv.verify(gold, pred, timeout_seconds=None)), extracted)


def _known_answer(text: str, extract: str) -> str | None:
    """What is known to be the answer before math-verify runs (boxed: the box; the other modes: nothing), the
    extracted text of a verdict that timed out or failed."""
    return text if extract == "boxed" else None


def _verify_in_main_thread(
    text: str, gold_content: str, timeout_s: float, extract: str = "boxed", max_chars: int = 1000
) -> Verdict:
    try:
        with _time_limit(timeout_s):
            return _verify_unguarded(text, gold_content, extract, max_chars)
    except _Timeout:
        logging.getLogger(__name__).warning("math-verify timed out after %.1fs on %.80r", timeout_s, text)
    except Exception:  # noqa: BLE001 - a reward never raises: malformed input scores 0
        pass
    return Verdict(False, _known_answer(text, extract))


def serve_worker(memory_mb: int = 4096) -> None:
    """Helper process body: one JSON request per stdin line [text, gold, timeout_s, extract, max_chars], one
    JSON line [correct 0/1, extracted text or null] out.

    Runs each verification on its own main thread under the signal timer; the parent enforces the hard
    bound by killing it. The address-space cap leaves room for what is already mapped."""
    import json
    import resource
    import sys

    _math_verify()  # imports first, so that the cap applies to the work, not to sympy's import
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    for line in sys.stdin:
        try:
            text, gold, timeout_s, extract, max_chars = json.loads(line)
            verdict = _verify_in_main_thread(text, gold, float(timeout_s), extract, int(max_chars))
            out = json.dumps([int(verdict.correct), verdict.extracted])
        except BaseException:  # noqa: BLE001 - MemoryError included: one bad answer must not end the helper
            out = "[0, null]"
        sys.stdout.write(out + "\n")
        sys.stdout.flush()


class _VerifyWorker:
    """The helper process behind isolation="process"; one request at a time (a lock serializes threads)."""

    GRACE_S = 1.0
    STARTUP_S = 60.0
    """Extra wait for the first answer: the helper imports sympy and math-verify (a few seconds, more on a
    loaded machine)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc = None
        self._warm = False
        self.restarts = 0
        """Helpers killed for running past their deadline (or found dead)."""

    def _start(self, memory_mb: int):
        import subprocess
        import sys

        # The package's parent directory on PYTHONPATH: works from a source checkout without an install.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"from megaopd.metrics.reward import serve_worker; serve_worker({int(memory_mb)})"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
        )
        self._warm = False

    def close(self):
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def __call__(self, text: str, gold_content: str, cfg: RewardConfig) -> Verdict:
        import json
        import select

        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start(cfg.worker_memory_mb)
            try:
                request = [text, gold_content, cfg.timeout_s, cfg.extract, cfg.max_answer_chars]
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
                wait = cfg.timeout_s + self.GRACE_S + (0.0 if self._warm else self.STARTUP_S)
                # One request in flight, one line back: nothing is left in the reader's buffer between calls,
                # so select on the pipe tells whether the answer has come.
                ready, _, _ = select.select([self._proc.stdout], [], [], wait)
                if ready:
                    line = self._proc.stdout.readline()
                    if line:
                        self._warm = True
                        correct, extracted = json.loads(line)
                        return Verdict(bool(correct), extracted)
            except (OSError, ValueError):
                pass
            logging.getLogger(__name__).warning(
                "math-verify helper exceeded %.1fs on %.80r; restarting it", cfg.timeout_s, text
            )
            self.close()
            self.restarts += 1
            return Verdict(False, _known_answer(text, cfg.extract))


_worker = _VerifyWorker()
atexit.register(_worker.close)


def extract_and_verify(response: str, gold: str, cfg: RewardConfig | None = None) -> Verdict:
    """The answer cfg.extract reads from `response` and whether it verifies against `gold` (a bare answer,
    $answer$, or a solution with a box). Never raises."""
    cfg = cfg or RewardConfig()
    known = None
    try:
        if cfg.extract == "boxed":
            text = known = last_boxed(response)
            if text is None or not text.strip() or len(text) > cfg.max_answer_chars:
                return Verdict(False, known)
        else:
            text = response
            if not text.strip():
                return Verdict(False, None)
        gold_content = _normalize_gold(gold)
        if not gold_content:
            return Verdict(False, known)
        if cfg.isolation == "none":
            return _verify_unguarded(text, gold_content, cfg.extract, cfg.max_answer_chars)
        if cfg.isolation == "signal" and threading.current_thread() is threading.main_thread():
            return _verify_in_main_thread(text, gold_content, cfg.timeout_s, cfg.extract, cfg.max_answer_chars)
        return _worker(text, gold_content, cfg)
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return Verdict(False, known)


def math_verify_reward(response: str, gold: str, cfg: RewardConfig | None = None) -> float:
    """1.0 when the answer cfg.extract reads from `response` (default: its last \\boxed{}) verifies against
    `gold`, else 0.0. Never raises."""
    return 1.0 if extract_and_verify(response, gold, cfg).correct else 0.0


def math_verify_rewards(responses: Sequence[str], golds: Sequence[str], cfg: RewardConfig | None = None) -> list[float]:
    """`math_verify_reward` of each (response, gold) pair."""
    if len(responses) != len(golds):
        raise ValueError(f"{len(responses)} responses but {len(golds)} gold answers: pass one gold per response")
    return [math_verify_reward(r, g, cfg) for r, g in zip(responses, golds)]
