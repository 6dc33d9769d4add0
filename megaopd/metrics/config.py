"""metrics: the job config's section of the training-dynamics metrics and the collapse early warning,
read by the trainer's step metrics (trainer/step_metrics.py) and its CollapseDetector."""
from __future__ import annotations

from dataclasses import dataclass, field

from megaopd.metrics.collapse import CollapseConfig
from megaopd.metrics.rollout import RepetitionConfig


@dataclass
class MetricsConfig:
    """Training-dynamics metrics (docs/algorithms.md section 2) and the collapse early warning."""

    repetition: RepetitionConfig = field(default_factory=RepetitionConfig)
    """Repetition rate (tail length L, ratio tau) and the repetitive-token n-gram."""
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    """Jump/level thresholds on the rollout truncation and repetition rates."""
    overlap_k: int = 16
    """k of the student/teacher top-k overlap metrics (paper 2604.13016: 16); 0 disables them."""
