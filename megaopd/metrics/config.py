"""metrics: the job config's section of the training-dynamics metrics, the collapse early warning and the
answer extraction and verification, read by the trainer's step metrics (trainer/step_metrics.py), its
CollapseDetector, its rewards and its validation (trainer/validation.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megaopd.metrics.collapse import CollapseConfig
from megaopd.metrics.reward import RewardConfig
from megaopd.metrics.rollout import RepetitionConfig


@dataclass
class MetricsConfig:
    """Training-dynamics metrics (docs/algorithms.md section 2), the collapse early warning, and how answers
    are extracted and verified."""

    repetition: RepetitionConfig = field(default_factory=RepetitionConfig)
    """Repetition rate (tail length L, ratio tau) and the repetitive-token n-gram."""
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    """Jump/level thresholds on the rollout truncation and repetition rates."""
    overlap_k: int = 16
    """k of the student/teacher top-k overlap metrics (paper 2604.13016: 16); 0 disables them."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How an answer is read from a response and verified (math-verify): `extract` (boxed, latex, number,
    answer_is, any; default boxed, the paper's rule), timeouts and isolation. One setting for the rollouts'
    rewards (rollout/reward_mean, GRPO) and validation (val/accuracy, val/answers_found); `megaopd eval`
    takes the same modes as --extract."""
