"""A resume with a changed config is explicit: the new config is compared with the run's stored
RUN/config.yaml before anything in the run folder is written.

    changes = config_changes(stored_yaml_dict, new_yaml_dict)   # every key whose value differs, dotted
    refuse_unappliable(changes, cfg, checkpoint_dir)            # ValueError: the keys and the fix, one line
    for c in changes: print(c.line(step))                       # config changed at step 40: optimizer.lr ...

What cannot apply is what the checkpoint's tensors were made of: the models (student, reference and teacher
paths: the student's weights and Adam state are the student's; the reference's KL and the teacher's scores
were the run's targets), the student's dtype, its LoRA adapters (student.lora enabled, rank, alpha, targets: the
checkpoint holds those adapters and their Adam state; its dropout applies), a student folder whose config.json
now has other shapes than the checkpoint's, the optimizer's checkpoint layout (optimizer.use_distributed_optimizer),
the student's TP/PP/EP with the distributed optimizer (its dp_reshardable layout reshards data-parallel ranks only; the
plain optimizer's state and the model reshard to any TP/PP/EP, trainer/checkpoint.py), and loss.controller
(the adaptive controller's state is a checkpoint component), and the data order (data.seed, data.shuffle, the
sources' count and weights: the data sampler's saved state replays that order, or refuses; a change of a
source's rows is the ranks' refusal, made before anything is written). Everything else applies from the resumed step:
the optimizer's lr, schedule and Adam settings (optim.ConfigSchedule makes the config win over the saved
schedule), max_steps, intervals, loss weights, rollout, data and logging settings.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: config composes every package's section, so no package imports it
    from megaopd.config.schema import MegaOPDConfig

SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_experts",
    "num_local_experts",
    "moe_intermediate_size",
    "tie_word_embeddings",
)
"""config.json keys that set the shapes of a checkpoint's tensors."""
_MODEL_KEYS = re.compile(
    r"^(student\.(path|dtype|lora\.(enabled|rank|alpha|targets))|reference\.path"
    r"|teachers\[\d+\]\.(path|name|engine)|teachers|optimizer\.use_distributed_optimizer|loss\.controller)$"
)
_LAYOUT_KEYS = re.compile(r"^student\.(tp|pp|ep)$")
_DATA_ORDER_KEYS = re.compile(r"^data\.(seed|shuffle|sources|sources\[\d+\]\.weight)$")
"""What the checkpoint's data order was drawn from (the sampler's saved seed, shuffle, source count and
weights): a resume replays that order or refuses; refused here, before any rank starts, by key."""
IGNORED = ("run.dir",)
"""Keys whose change says nothing about the run (a run folder may be moved)."""


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any

    def line(self, step: int) -> str:
        return f"config changed at step {step}: {self.key} {_fmt(self.old)} -> {_fmt(self.new)}"


def _fmt(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    if isinstance(value, float):
        return f"{value:g}"
    return json.dumps(value) if isinstance(value, (list, dict, str)) and value in ("", [], {}) else str(value)


_ABSENT = object()


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a config mapping; lists of mappings by index (teachers[0].path), other lists whole.
    A list of mappings also keeps its length under its own key, so a teacher added or removed shows."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(node, list) and node and all(isinstance(v, dict) for v in node):
        out = {f"{prefix}": f"{len(node)} entries"}
        for i, value in enumerate(node):
            out.update(_flatten(value, f"{prefix}[{i}]"))
        return out
    return {prefix: node}


def config_changes(old: dict, new: dict) -> list[Change]:
    """Every dotted key whose value differs between two resolved configs (as RUN/config.yaml holds them)."""
    a, b = _flatten(old), _flatten(new)
    keys = [k for k in b if k not in IGNORED] + [k for k in a if k not in b and k not in IGNORED]
    return [
        Change(k, a.get(k, _ABSENT), b.get(k, _ABSENT))
        for k in keys
        if not _same(k, a.get(k, _ABSENT), b.get(k, _ABSENT))
    ]


def _same(key: str, old: Any, new: Any) -> bool:
    """Equal values; a folder named relatively once and absolutely the next time is the same folder."""
    if old == new:
        return True
    return (
        key.endswith(".path")
        and isinstance(old, str)
        and isinstance(new, str)
        and bool(old)
        and bool(new)
        and os.path.realpath(old) == os.path.realpath(new)
    )


def _shape_changes(student_path: str, checkpoint_dir: str) -> list[str]:
    """The shape keys of config.json that differ between the student folder and the checkpoint's copy."""
    from megaopd.models.config import find_hf_config

    try:
        with open(find_hf_config(student_path)) as f:
            now = json.load(f)
        with open(find_hf_config(checkpoint_dir)) as f:
            saved = json.load(f)
    except FileNotFoundError:
        return []
    return [
        f"{student_path}/config.json {k} {saved.get(k)} -> {now.get(k)}"
        for k in SHAPE_KEYS
        if k in now or k in saved
        if now.get(k) != saved.get(k)
    ]


def unappliable(changes: list[Change], cfg: MegaOPDConfig, checkpoint_dir: str) -> list[str]:
    """The changes a resume from `checkpoint_dir` cannot apply, each as `key old -> new`."""
    refused = [
        c
        for c in changes
        if _MODEL_KEYS.match(c.key)
        or _DATA_ORDER_KEYS.match(c.key)
        or (_LAYOUT_KEYS.match(c.key) and cfg.optimizer.use_distributed_optimizer)
    ]
    return [f"{c.key} {_fmt(c.old)} -> {_fmt(c.new)}" for c in refused] + _shape_changes(
        cfg.student.path, checkpoint_dir
    )


def saved_state_refusals(cfg: MegaOPDConfig, checkpoint_dir: str, step: int) -> list[str]:
    """What the checkpoint's trainer_state.json says against this resume, read before any rank starts: a step
    other than the manifest's (`step`), a data order (seed, shuffle, sources' weights) other than the config's.
    The rest of the sampler's state (each source's size) needs the data loaded: the ranks check it, before
    anything is written."""
    path = os.path.join(checkpoint_dir, "trainer_state.json")
    try:
        with open(path) as f:
            state = json.load(f)
        saved_step = int(state["step"])
    except FileNotFoundError:
        return []  # the ranks' load names it
    except (ValueError, KeyError, TypeError) as e:
        return [f"{path} is not a trainer state ({type(e).__name__}: {e})"]
    refused = []
    if saved_step != step:
        refused.append(f"{path} records step {saved_step} but its manifest step {step}")
    sampler = (state.get("data") or {}).get("sampler") if isinstance(state.get("data"), dict) else None
    if isinstance(sampler, dict):
        now = {"seed": cfg.data.seed, "shuffle": cfg.data.shuffle, "weights": list(cfg.data.weights)}
        refused += [
            f"data order {key} {sampler[key]} (saved) -> {value}"
            for key, value in now.items()
            if key in sampler and sampler[key] != value
        ]
    return refused


def refusal(run_dir: str, step: int, refused: list[str]) -> str:
    return (
        f"cannot resume {run_dir} (checkpoint at step {step}) with {'; '.join(refused)}: the checkpoint was "
        f"made of the old models and layout, so these cannot apply to it; start a new run.dir (e.g. "
        f"student.path=CHECKPOINT to start from its weights), or revert these keys to resume"
    )
