# Put first on PYTHONPATH by tests/envs/test_agentic_resume.py: every process of that run (the launcher and
# its spawned workers) starts with every environment an AlwaysAnswers, so that `megaopd train` makes
# multi-turn trajectories from the tiny student (which never calls the calculator by itself).
import megaopd.rollout.trajectories as _trajectories
from tests.envs._workers import AlwaysAnswers as _AlwaysAnswers

_trajectories.build_environment = lambda env_cfg: _AlwaysAnswers()
