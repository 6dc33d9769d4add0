"""Spawned worker of the streaming rollout flow test (module level, importable by spawned processes)."""

from __future__ import annotations

import os
import time

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "tiny")


class FakeEngine:
    """Answers each prompt with n samples [first id, sample index]; `fail_at`: the part starting there raises;
    parts come back last first (the part at prompt 0 the slowest)."""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at

    def generate(self, prompts, params, first_prompt_index=0):
        from megaopd.rollout.protocol import Sample

        if first_prompt_index == self.fail_at:
            raise RuntimeError(f"engine failed on the part at prompt {first_prompt_index}")
        time.sleep({0: 1.0, 3: 0.5}.get(first_prompt_index, 0.0))
        return [Sample(list(p), [p[0], j], [-0.5, -0.25], "stop") for p in prompts for j in range(params.n)]


class Ex:
    def __init__(self, i):
        self.prompt_ids, self.teacher = [100 + i, 7], ""


def stream(rank, world_size, prompts, fail_at, consumer_sleep=0.0):
    from megaopd.config import load_config
    from megaopd.config.schema import MegaOPDConfig
    from megaopd.trainer.rollout_flow import EngineHooks, RolloutFlow
    from megaopd.trainer.timer import Timer

    cfg = load_config(
        MegaOPDConfig,
        os.path.join(TINY, "stable_opd.yaml"),
        [
            "rollout.engine=remote",
            "rollout.urls=[http://127.0.0.1:9]",
            "rollout.stream_parts=3",
            "trainer.samples_per_prompt=2",
        ],
    )
    flow = RolloutFlow(cfg, None, Timer(), [0], rank, EngineHooks(parity=lambda _engine: None))
    flow.attach(FakeEngine(fail_at), weight_sync=object())  # nothing is pushed here
    examples = [Ex(i) for i in range(prompts)]
    parts, by_row = [], {}
    try:
        for part in flow.parts(0, examples):
            parts.append((part.rows, [s.output_ids for s in part.samples]))
            by_row.update(zip(part.rows, part.samples))
            time.sleep(consumer_sleep)  # a slow scoring pass: the parts that arrive meanwhile come together
    except RuntimeError as e:
        return {"error": str(e), "parts": parts}
    return {
        "parts": parts,
        "all": [by_row[r].output_ids for r in range(len(by_row))],
        "streams": flow.streams,
        "versions": flow.versions_B,
    }
