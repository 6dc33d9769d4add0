"""Load a config: schema defaults <- YAML preset(s) <- `key=value` overrides, then validate.

    cfg = load_config(MegaOPDConfig, "examples/tiny/stable_opd.yaml", ["trainer.max_steps=3"])

Every error comes out as one ConfigError line naming the key and the fix: an unknown key (with the
keys that section accepts), a value of the wrong type, a failed __post_init__ check.
"""
from __future__ import annotations

import os
from typing import Sequence, Type, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot run; the message says which key and how to fix it."""


def _accepted_keys(schema, dotted_key: str) -> list[str]:
    node = schema
    for part in dotted_key.split(".")[:-1]:
        node = node.get(part) if OmegaConf.is_dict(node) else None
        if node is None:
            return []
    return sorted(node.keys()) if OmegaConf.is_dict(node) else []


def _merge(schema, other, source: str):
    try:
        return OmegaConf.merge(schema, other)
    except ConfigKeyError as e:
        key = e.full_key or e.key
        accepted = _accepted_keys(schema, str(key))
        hint = f"; this section accepts: {', '.join(accepted)}" if accepted else ""
        raise ConfigError(f"unknown config key {key!r} in {source}{hint}") from None
    except OmegaConfBaseException as e:
        msg = str(e).splitlines()[0]
        raise ConfigError(f"bad value for {e.full_key!r} in {source}: {msg}") from None


def _dotted_keys(node, prefix: str = "") -> list[str]:
    """Every key of a loaded YAML mapping, dotted (trainer.max_steps); list items are not descended."""
    out = []
    for key, value in node.items_ex(resolve=False) if OmegaConf.is_dict(node) else []:
        out.append(f"{prefix}{key}")
        if OmegaConf.is_dict(value):
            out += _dotted_keys(value, f"{prefix}{key}.")
    return out


def _refuse_removed(removed: dict[str, str], keys: Sequence[str], source: str) -> None:
    for key in keys:
        if key in removed:
            raise ConfigError(f"{key} was removed ({removed[key]}): delete it from {source}")


def load_config(schema_cls: Type[T], preset: str | Sequence[str] | None = None,
                overrides: Sequence[str] = ()) -> T:
    """Returns a validated `schema_cls` instance (its __post_init__ checks have run). Keys the schema lists
    in a REMOVED_KEYS class attribute ({dotted key: why}) are refused with that reason."""
    removed = getattr(schema_cls, "REMOVED_KEYS", {})
    cfg = OmegaConf.structured(schema_cls)
    presets = [preset] if isinstance(preset, str) else list(preset or [])
    for path in presets:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist: pass a YAML preset such as "
                              f"examples/tiny/stable_opd.yaml")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # noqa: BLE001 - yaml's scanner/parser errors have no common public base
            raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]} "
                              f"({' '.join(str(e).split()[-4:])})") from None
        _refuse_removed(removed, _dotted_keys(loaded), path)
        cfg = _merge(cfg, loaded, path)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not of the form key=value (e.g. trainer.max_steps=10)")
    _refuse_removed(removed, [o.split("=", 1)[0] for o in overrides], "the command-line overrides")
    cfg = _merge(cfg, OmegaConf.from_dotlist(list(overrides)), "command-line overrides")
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    except ValueError as e:  # a __post_init__ check
        raise ConfigError(str(e)) from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from None
    return obj


def to_yaml(cfg) -> str:
    """The resolved config as YAML (written to RUN/config.yaml)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
