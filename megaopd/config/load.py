"""Load a config: schema defaults <- YAML preset(s) <- `key=value` overrides, then validate.

    cfg = load_config(MegaOPDConfig, "examples/tiny/stable_opd.yaml", ["trainer.max_steps=3"])

Overrides replace or clear what a YAML set, in their order on the command line:
    key=value        merged as omegaconf merges (a non-empty mapping merges into the section)
    key=  key=null   clears: "" for a string, {} / [] for a mapping or list (a dataclass section: its
    key={}  key=[]   defaults), None where the key is optional; a number or a flag cannot be empty
    ~key             back to the schema's default
A schema's RESET_ON_CHANGE ({key: dependent key}) resets the dependent key to its default when an override
changes the key's value, before any override applies: `loss.name=opd` over a YAML with stable_opd's
`loss.config` starts from opd's defaults (loss.config.* overrides then apply on top).

Every error comes out as one ConfigError line naming the key and the fix: an unknown key (with the
keys that section accepts), a value of the wrong type, a failed __post_init__ check.
"""

from __future__ import annotations

import os
from dataclasses import is_dataclass
from typing import Sequence, Type, TypeVar

import yaml
from omegaconf import OmegaConf, StringNode
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
    """A removed key, or a key under one (metrics.collapse.jump.truncation_rate), stops the load with its reason."""
    for key in keys:
        gone = next((r for r in removed if key == r or key.startswith(r + ".")), None)
        if gone is not None:
            raise ConfigError(f"{gone} was removed ({removed[gone]}): delete it from {source}")


def _node(cfg, key: str):
    """The node of a dotted key (None when a part is unknown)."""
    parent_key, _, last = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if not OmegaConf.is_dict(parent) or last not in parent:
        return None
    return parent._get_node(last)


def _set(cfg, key: str, value) -> None:
    try:
        OmegaConf.update(cfg, key, value, merge=False)
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad value for {key!r} in command-line overrides: {str(e).splitlines()[0]}") from None


def _cleared(defaults, node, key: str):
    """What `key=` (or null, {}, []) sets: see the module docstring."""
    if node._metadata.optional:
        return None
    if isinstance(node, StringNode):
        return ""
    if OmegaConf.is_dict(node) or OmegaConf.is_list(node):
        structured = OmegaConf.is_dict(node) and is_dataclass(OmegaConf.get_type(node))
        return OmegaConf.select(defaults, key) if structured else ({} if OmegaConf.is_dict(node) else [])
    raise ConfigError(f"{key} cannot be empty: give it a value (e.g. {key}={node._value()}), or ~{key} for its default")


def _apply_override(cfg, defaults, override: str):
    if override.startswith("~"):
        key = override[1:].split("=", 1)[0]
        if _node(cfg, key) is None:
            return _merge(cfg, OmegaConf.from_dotlist([f"{key}=null"]), "command-line overrides")  # unknown-key error
        _set(cfg, key, OmegaConf.select(defaults, key))
        return cfg
    key = override.split("=", 1)[0]
    try:
        parsed = OmegaConf.from_dotlist([override])
    except yaml.YAMLError as e:  # a value read as YAML: `{golden} ...` opens a mapping that never closes
        first = str(e).strip().splitlines()[0]
        raise ConfigError(
            f"override {override!r} is not valid YAML ({first}): quote the value, e.g. '{key}=\"...\"'"
        ) from None
    value = OmegaConf.select(parsed, key)
    node = _node(cfg, key)
    if node is not None and (
        value is None or ((OmegaConf.is_dict(value) or OmegaConf.is_list(value)) and len(value) == 0)
    ):
        _set(cfg, key, _cleared(defaults, node, key))
        return cfg
    return _merge(cfg, parsed, "command-line overrides")


def _reset_on_change(cfg, defaults, reset: dict[str, str], overrides: Sequence[str]) -> None:
    for override in overrides:
        key = override.split("=", 1)[0]
        if key in reset and "=" in override:
            new = OmegaConf.select(OmegaConf.from_dotlist([override]), key)
            if new != OmegaConf.select(cfg, key):
                _set(cfg, reset[key], OmegaConf.select(defaults, reset[key]))


def load_config(
    schema_cls: Type[T], preset: str | Sequence[str] | None = None, overrides: Sequence[str] = (), validate: bool = True
) -> T:
    """Returns a validated `schema_cls` instance (its __post_init__ checks have run). Keys the schema lists
    in a REMOVED_KEYS class attribute ({dotted key: why}), and the keys under them, are refused with that
    reason. validate=False leaves out the schema's `validate()` (the checks that read files), for a caller
    that runs it itself."""
    removed = getattr(schema_cls, "REMOVED_KEYS", {})
    cfg = OmegaConf.structured(schema_cls)
    presets = [preset] if isinstance(preset, str) else list(preset or [])
    for path in presets:
        if not os.path.isfile(path):
            raise ConfigError(
                f"config file {path!r} does not exist: pass a YAML preset such as examples/tiny/stable_opd.yaml"
            )
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # noqa: BLE001 - yaml's scanner/parser errors have no common public base
            raise ConfigError(
                f"{path} is not valid YAML: {str(e).splitlines()[0]} ({' '.join(str(e).split()[-4:])})"
            ) from None
        _refuse_removed(removed, _dotted_keys(loaded), path)
        cfg = _merge(cfg, loaded, path)
    bad = [o for o in overrides if "=" not in o and not o.startswith("~")]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not of the form key=value (e.g. trainer.max_steps=10)")
    _refuse_removed(removed, [o.split("=", 1)[0].lstrip("~") for o in overrides], "the command-line overrides")
    defaults = OmegaConf.structured(schema_cls)
    _reset_on_change(cfg, defaults, getattr(schema_cls, "RESET_ON_CHANGE", {}), overrides)
    for override in overrides:
        cfg = _apply_override(cfg, defaults, override)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    except ValueError as e:  # a __post_init__ check
        raise ConfigError(str(e)) from None
    check = getattr(obj, "validate", None) if validate else None
    if callable(check):
        try:
            check()
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from None
    return obj


def to_yaml(cfg) -> str:
    """The resolved config as YAML (written to RUN/config.yaml)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
