"""megaopd.rollout: the trainer's view of engines: the engine protocol, the embedded engine as an Engine,
the SGLang HTTP client and pool, the /generate schema and weight wire format that client and server share,
the RolloutBatch and TokenScores records; build_engine(rollout_cfg, hf_dir) makes the engine a config
describes."""

from megaopd.rollout.build import build_engine

__all__ = ["build_engine"]
