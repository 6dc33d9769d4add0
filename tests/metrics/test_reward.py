"""math-verify reward: correct, wrong, equivalent forms, malformed input, timeouts, threads."""

import os
import signal
import threading
import time

import pytest

from megaopd.metrics import RewardConfig, last_boxed, math_verify_reward, math_verify_rewards
from megaopd.metrics import reward as reward_mod


def test_last_boxed():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\left\\{1,2\\right\\}}") == "\\left\\{1,2\\right\\}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("so $\\boxed 5$.") == "5"
    assert last_boxed("no box, answer 5") is None
    assert last_boxed("\\boxed{12") is None  # truncated mid-answer
    assert last_boxed("\\boxed") is None
    assert last_boxed("\\boxed{}") == ""


@pytest.mark.parametrize(
    "response, gold, expected",
    [
        ("The answer is \\boxed{42}.", "42", 1.0),
        ("The answer is \\boxed{41}.", "42", 0.0),
        # equivalent forms of one half, both ways round
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{1/2}", "0.5", 1.0),
        ("\\boxed{\\frac12}", "1/2", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "$\\frac{1}{2}$", 1.0),
        ("\\boxed{\\sqrt{18}}", "3\\sqrt{2}", 1.0),
        ("\\boxed{1+x^2}", "x^2+1", 1.0),
        # gold given as a full solution with its own box
        ("\\boxed{6}", "Since 2*3 = 6, we get \\boxed{6}.", 1.0),
        # only the last box counts
        ("first \\boxed{42}, no wait, \\boxed{43}", "42", 0.0),
        ("first \\boxed{43}, no wait, \\boxed{42}", "42", 1.0),
        # missing / malformed answers are wrong, never errors
        ("The answer is 42", "42", 0.0),
        ("\\boxed{}", "42", 0.0),
        ("\\boxed{42", "42", 0.0),
        ("\\boxed{\\frac{1}{}}", "42", 0.0),
        ("\\boxed{)(*&^%$#@!}", "42", 0.0),
        ("", "42", 0.0),
        ("\\boxed{42}", "", 0.0),
        ("\\boxed{" + "9" * 5000 + "}", "42", 0.0),
    ],
)
def test_reward_cases(response, gold, expected):
    assert math_verify_reward(response, gold) == expected


def test_rewards_batch_and_length_check():
    assert math_verify_rewards(["\\boxed{1}", "\\boxed{2}"], ["1", "1"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="one gold per response"):
        math_verify_rewards(["\\boxed{1}"], [])


@pytest.mark.parametrize("isolation", ["signal", "none"])
def test_in_process_modes_agree(isolation):
    cfg = RewardConfig(isolation=isolation)
    assert math_verify_reward("\\boxed{0.5}", "\\frac{1}{2}", cfg) == 1.0
    assert math_verify_reward("\\boxed{3}", "2", cfg) == 0.0
    assert math_verify_reward("no box", "2", cfg) == 0.0


def test_signal_timeout_scores_zero_and_restores_callers_timer(monkeypatch):
    def slow(*args):
        time.sleep(5)
        return True

    monkeypatch.setattr(reward_mod, "_verify_unguarded", slow)
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)  # a caller's watchdog
        t0 = time.monotonic()
        assert math_verify_reward("\\boxed{1}", "1", RewardConfig(timeout_s=0.2, isolation="signal")) == 0.0
        assert time.monotonic() - t0 < 2.0
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < remaining <= 30.0  # the watchdog survived, less the time we used
        assert not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _in_thread(fn):
    out = []
    th = threading.Thread(target=lambda: out.append(fn()))
    th.start()
    th.join()
    return out[0]


def test_off_main_thread():
    # Default (helper process) and signal mode (falls back to the helper off the main thread).
    for cfg in (RewardConfig(), RewardConfig(isolation="signal"), RewardConfig(isolation="none")):
        assert _in_thread(lambda cfg=cfg: math_verify_reward("\\boxed{0.5}", "\\frac{1}{2}", cfg)) == 1.0
        assert _in_thread(lambda cfg=cfg: math_verify_reward("\\boxed{3}", "2", cfg)) == 0.0


def test_process_isolation_bounds_a_power_tower():
    """In-process, sympy's evalf of this tower ran 27 s past a 2 s alarm (mpmath's C integer power, where no
    signal lands); the helper process (its timer, memory cap, or the parent's kill) bounds it."""
    assert math_verify_reward("\\boxed{1}", "1") == 1.0  # helper warm
    t0 = time.monotonic()
    assert math_verify_reward("\\boxed{10^{10^{10^{10^{10}}}}}", "x+1", RewardConfig(timeout_s=1.0)) == 0.0
    assert time.monotonic() - t0 < 1.0 + reward_mod._VerifyWorker.GRACE_S + 1.0
    assert math_verify_reward("\\boxed{\\frac{1}{2}}", "0.5") == 1.0


@pytest.mark.slow
def test_unresponsive_helper_is_killed_and_replaced():
    assert math_verify_reward("\\boxed{1}", "1") == 1.0  # helper warm
    w = reward_mod._worker
    restarts = w.restarts
    os.kill(w._proc.pid, signal.SIGSTOP)  # a helper stuck where nothing interrupts it
    t0 = time.monotonic()
    assert math_verify_reward("\\boxed{1}", "1", RewardConfig(timeout_s=0.5)) == 0.0
    assert time.monotonic() - t0 < 0.5 + w.GRACE_S + 1.0
    assert w.restarts == restarts + 1
    assert math_verify_reward("\\boxed{\\frac{1}{2}}", "0.5") == 1.0  # a fresh helper answers
