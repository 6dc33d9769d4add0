"""megaopd.metrics: rollout and validation metrics (ALGORITHMS.md section 2), the math-verify reward,
the collapse early warning, and `megaopd plot`.

    rollout.py   truncation / repetition rates, repetitive-token mask, advantage split, rollout dynamics
    overlap.py   student/teacher top-k overlap ratio and mass, entropy gap
    reward.py    math_verify_reward: last \\boxed{} answer vs gold, never raises, time-bounded
    collapse.py  CollapseDetector: jump/level alarms on truncation and repetition rates
    plot.py      `megaopd plot RUN [RUN ...]`: training-dynamics figures from RUN/metrics.jsonl
"""
from megaopd.metrics.collapse import CollapseConfig, CollapseDetector, CollapseWarning
from megaopd.metrics.overlap import topk_overlap, topk_overlap_counts, topk_overlap_from_counts
from megaopd.metrics.reward import RewardConfig, last_boxed, math_verify_reward, math_verify_rewards
from megaopd.metrics.rollout import (
    RepetitionConfig,
    advantage_split,
    advantage_split_counts,
    advantage_split_from_counts,
    compression_ratio,
    is_repetitive,
    repetition_rate,
    repetitive_token_flags,
    repetitive_token_mask,
    response_metrics,
    rollout_dynamics,
    truncation_rate,
)

__all__ = [
    "CollapseConfig", "CollapseDetector", "CollapseWarning",
    "topk_overlap", "topk_overlap_counts", "topk_overlap_from_counts",
    "RewardConfig", "last_boxed", "math_verify_reward", "math_verify_rewards",
    "RepetitionConfig", "advantage_split", "advantage_split_counts", "advantage_split_from_counts",
    "compression_ratio", "is_repetitive", "repetition_rate", "repetitive_token_flags", "repetitive_token_mask",
    "response_metrics", "rollout_dynamics", "truncation_rate",
]
