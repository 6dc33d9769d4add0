"""megaopd.rollout: the engine protocol, the embedded engine and `megaopd serve`, the SGLang client,
launcher and pool; build_engine(rollout_cfg, hf_dir) makes the engine a config describes."""
from megaopd.rollout.build import build_engine

__all__ = ["build_engine"]
