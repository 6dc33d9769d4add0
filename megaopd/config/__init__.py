"""Structured configs (omegaconf dataclasses): one small dataclass per package, composed at the top.

Loading: `load_config(Schema, preset_yaml, ["key=value", ...])` merges defaults, presets and command-line
overrides and validates; every error is one ConfigError line naming the key and the fix.
"""

from megaopd.config.load import ConfigError, load_config, to_yaml

__all__ = ["ConfigError", "load_config", "to_yaml"]
