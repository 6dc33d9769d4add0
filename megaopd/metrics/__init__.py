"""megaopd.metrics: rollout and validation metrics (docs/algorithms.md section 2), the math-verify reward,
the collapse early warning, and `megaopd plot`.

    rollout.py   truncation / repetition rates, repetitive-token mask, advantage split, rollout dynamics
    overlap.py   student/teacher top-k overlap ratio and mass, entropy gap
    reward.py    math_verify_reward: the extracted answer (RewardConfig.extract) vs gold, never raises, time-bounded
    trajectory.py  multi-turn trajectories: turns, tool calls and errors, environment-token share
    collapse.py  CollapseDetector: jump/level alarms on the ResponseRates of each step (truncation, repetition)
    plot.py      `megaopd plot RUN [RUN ...]`: training-dynamics figures from RUN/metrics.jsonl
"""

import importlib

# name -> submodule. Imported on first use (PEP 562), so that the math-verify helper process and
# `megaopd plot` do not pay for torch.
_EXPORTS = {
    "collapse": ["CollapseConfig", "CollapseDetector", "CollapseWarning", "RateThresholds"],
    "overlap": ["topk_overlap", "topk_overlap_counts", "topk_overlap_from_counts"],
    "reward": [
        "EXTRACTIONS",
        "RewardConfig",
        "Verdict",
        "extract_and_verify",
        "few_answers_warning",
        "last_boxed",
        "math_verify_reward",
        "math_verify_rewards",
    ],
    "rollout": [
        "AdvantageSplit",
        "RepetitionConfig",
        "ResponseRates",
        "advantage_split",
        "advantage_split_counts",
        "advantage_split_from_counts",
        "advantage_split_of",
        "compression_ratio",
        "is_repetitive",
        "repetition_rate",
        "repetitive_token_flags",
        "repetitive_token_mask",
        "response_metrics",
        "response_rates",
        "rollout_dynamics",
        "rollout_dynamics_counts",
        "rollout_dynamics_from_counts",
        "truncation_rate",
    ],
    "trajectory": ["trajectory_metrics"],
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"megaopd.metrics.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'megaopd.metrics' has no attribute {name!r}")
