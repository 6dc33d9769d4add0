"""The rollout engine a RolloutConfig describes, built on trainer rank 0.

    engine = build_engine(cfg.rollout, hf_dir)   # hf_dir: the student's HF dir (or its HF export)

rollout.engine = embedded: an EmbeddedEngine in this process, built from hf_dir (the actor's weights
are synced in right after, so hf_dir only has to have the student's architecture and tokenizer).
rollout.engine = remote: an EnginePool over one HttpEngine per rollout.urls entry (each with
rollout.engine_tp workers); hf_dir is not read: the servers loaded their own copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megaopd.engine.config import EmbeddedEngineConfig
from megaopd.rollout.client import HttpEngine, HttpEngineConfig
from megaopd.rollout.config import RolloutConfig, RolloutEngine
from megaopd.rollout.embedded import EmbeddedEngine
from megaopd.rollout.pool import EnginePool, PoolConfig


def build_engine(
    rollout: RolloutConfig,
    hf_dir: str,
    context_length: int = 0,
    dtype: str = "float32",
    stop: Callable[[], bool] | None = None,
):
    """An Engine (see megaopd.rollout.protocol) for `rollout`; pass it to megaopd.sync.WeightSync.
    context_length: the longest row the job generates (MegaOPDConfig.generated_row_tokens), which sizes the
    embedded engine's KV cache; 0 = what fits (a server's sizing). dtype: the embedded engine's
    (MegaOPDConfig.embedded_engine_dtype). stop: remote engines give up any wait once it is true (the
    trainer's PreemptionFlag.signalled; megaopd.rollout.waits)."""
    return BUILDERS[rollout.engine](EngineSetup(rollout, hf_dir, context_length, dtype, stop))


@dataclass(frozen=True)
class EngineSetup:
    """What build_engine's caller gives (its docstring); each builder reads what its kind needs."""

    rollout: RolloutConfig
    hf_dir: str
    context_length: int
    dtype: str
    stop: Callable[[], bool] | None


def _remote(setup: EngineSetup) -> EnginePool:
    rollout = setup.rollout
    engines = [
        HttpEngine(
            HttpEngineConfig(
                url=url,
                workers=rollout.engine_tp,
                name=f"rollout.urls[{i}]",
                stall_timeout_s=rollout.stall_timeout_s,
                api_key_env=rollout.api_key_env,
                vocab_size=_vocab_size(setup.hf_dir),  # generated ids outside the student's are refused
            ),
            stop=setup.stop,
        )
        for i, url in enumerate(rollout.urls)
    ]
    return EnginePool(engines, PoolConfig(timeout_s=rollout.request_timeout_s))


def _embedded(setup: EngineSetup) -> EmbeddedEngine:
    return EmbeddedEngine(
        EmbeddedEngineConfig(
            hf_dir=setup.hf_dir,
            max_batch_size=setup.rollout.max_batch_size,
            context_length=setup.context_length,
            dtype=setup.dtype,
        )
    )


BUILDERS: dict[RolloutEngine, Callable[[EngineSetup], object]] = {
    RolloutEngine.EMBEDDED: _embedded,
    RolloutEngine.REMOTE: _remote,
}
"""Each rollout engine kind's builder: a new kind is its RolloutEngine member and one entry here."""


def _vocab_size(hf_dir: str) -> int:
    """The student's vocabulary size from its config.json (0 when there is none to read: not checked)."""
    from megaopd.models.config import read_config_json

    try:
        return int(read_config_json(hf_dir).get("vocab_size") or 0)
    except (FileNotFoundError, ValueError, TypeError):
        return 0
