"""rollout.stream_parts: a batch generated as concurrent parts (megaopd.rollout.trajectories.generate_rows)
against `megaopd serve` is the batch one request gives, sample for sample, and each part is handed on once,
with its first batch row, as it returns."""

import os
import threading

import pytest

from megaopd.rollout.build import build_engine
from megaopd.rollout.config import RolloutConfig
from megaopd.rollout.embedded import EmbeddedEngine
from megaopd.rollout.protocol import SamplingParams
from megaopd.rollout.trajectories import generate_rows
from megaopd.serving.server import RolloutServer, ServeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUDENT = os.path.join(ROOT, "examples", "tiny", "models", "student")


class Ex:
    def __init__(self, i):
        self.prompt_ids, self.teacher = [5 + i, 17, 30 + 2 * i], ""


def test_parts_give_the_samples_of_one_request(one_torch_thread):
    config = ServeConfig(hf_dir=STUDENT, port=0)
    server = RolloutServer(config, engine=EmbeddedEngine(config.engine_config())).start()
    try:
        engine = build_engine(RolloutConfig(engine="remote", urls=[server.url]), STUDENT)
        examples = [Ex(i) for i in range(7)]
        params = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=99)
        whole = generate_rows(engine, examples, params, None)
        got, lock = [], threading.Lock()

        def on_part(first_row, exs, samples):
            with lock:
                got.append((first_row, [e.prompt_ids for e in exs], samples))

        parts = generate_rows(engine, examples, params, None, parts=3, on_part=on_part)
    finally:
        server.shutdown()
    assert [s.output_ids for s in parts] == [s.output_ids for s in whole]
    # The engine's log-probs of the same tokens may round differently when the parts share its batch
    # with other rows (~1e-6): the tokens are the contract.
    for a, b in zip(parts, whole):
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
    got.sort(key=lambda g: g[0])
    assert [g[0] for g in got] == [0, 6, 12]  # parts of 3, 3 and 1 prompts, n = 2 rows each
    for first_row, prompts, samples in got:
        assert [s.prompt_ids for s in samples] == [p for p in prompts for _ in range(2)]
        assert [s.output_ids for s in samples] == [s.output_ids for s in whole[first_row : first_row + len(samples)]]


def test_stream_parts_needs_remote_engines():
    with pytest.raises(ValueError, match="stream_parts"):
        RolloutConfig(stream_parts=4)
    assert RolloutConfig(engine="remote", urls=["http://h:1"], stream_parts=4).stream_parts == 4
