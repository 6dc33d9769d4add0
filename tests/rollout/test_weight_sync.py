"""A `megaopd serve` process and a trainer (this process, rank 0) syncing weights over a gloo group;
attaching to a started server; the pool's failover and timeouts (the launcher's own tests:
tests/serving/test_sglang_launcher.py)."""

import socket
import time

import pytest
import torch

from megaopd.engine.config import EmbeddedEngineConfig
from megaopd.parallel.dist import find_free_port
from megaopd.rollout.client import EngineError, EngineUnavailableError, HttpEngine, HttpEngineConfig
from megaopd.rollout.embedded import EmbeddedEngine
from megaopd.rollout.pool import EnginePool, PoolConfig, PoolError
from megaopd.rollout.protocol import SamplingParams
from megaopd.serving.sglang_launcher import ServerProcess, megaopd_serve_command
from megaopd.sync.distributed import DistGroupTransport, DistributedUpdateConfig, DistributedWeightUpdater
from tests.engine._models import hf_logprobs, random_state_dict

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
PARAMS = SamplingParams(n=2, max_new_tokens=10, temperature=1.0, seed=21)


def gap(model, samples):
    return max(
        (hf_logprobs(model, s.prompt_ids, s.output_ids, 1.0) - torch.tensor(s.output_logprobs, dtype=torch.float64))
        .abs()
        .max()
        .item()
        for s in samples
    )


def test_client_timeouts_and_retries():
    # A socket that accepts connections and never answers: every attempt times out, then a clear error.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        client = HttpEngine(
            HttpEngineConfig(
                url=f"http://127.0.0.1:{sock.getsockname()[1]}", control_timeout_s=0.3, retries=2, backoff_s=0.05
            )
        )
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailableError, match="after 3 attempt"):
            client.model_info()
        assert time.monotonic() - t0 < 5
        assert not client.health()
    finally:
        sock.close()
    dead = HttpEngine(HttpEngineConfig(url=f"http://127.0.0.1:{find_free_port()}", retries=1, backoff_s=0.01))
    with pytest.raises(EngineUnavailableError, match="Connection refused|ConnectionRefused|URLError"):
        dead.generate([[1]], SamplingParams(max_new_tokens=1))


class _Flaky:
    """An engine that fails after `ok_calls` successful calls (or hangs, with hang=True)."""

    def __init__(self, inner, ok_calls=0, hang=False):
        self.inner, self.ok_calls, self.hang, self.calls = inner, ok_calls, hang, 0

    def generate(self, prompts, params, first_prompt_index=0):
        self.calls += 1
        if self.calls > self.ok_calls:
            if self.hang:
                time.sleep(30)
            raise EngineUnavailableError("engine died mid-generation")
        return self.inner.generate(prompts, params, first_prompt_index=first_prompt_index)

    def health(self):
        return False

    def __repr__(self):
        return "Flaky"


def test_pool_spreads_orders_and_fails_over(engine):
    want = engine.generate(PROMPTS * 3, PARAMS)
    pool = EnginePool([engine, _Flaky(engine), engine], PoolConfig(prompts_per_job=2))
    got = pool.generate(PROMPTS * 3, PARAMS)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]  # in order, seeds by batch index
    assert pool.failed == {1}
    # Every engine failing: a clear error, not a hang.
    with pytest.raises(PoolError, match="failed on"):
        EnginePool([_Flaky(engine), _Flaky(engine)], PoolConfig(max_attempts=5)).generate(PROMPTS, PARAMS)
    t0 = time.monotonic()
    with pytest.raises(PoolError, match="did not finish"):
        EnginePool([_Flaky(engine, hang=True)], PoolConfig(timeout_s=0.5)).generate(PROMPTS, PARAMS)
    assert time.monotonic() - t0 < 5


@pytest.fixture(scope="module")
def served(tiny_dir):
    """`megaopd serve` in its own process, started through the launcher (the SGLang start path)."""
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    with ServerProcess.start(
        megaopd_serve_command(tiny_dir, port, extra_args=["--num-threads", "1"]), url=url, startup_timeout_s=120
    ) as server:
        yield server


@pytest.mark.slow
def test_attach_and_generate(served, tiny_dir):
    server = ServerProcess.attach(served.url, timeout_s=10)
    server.stop()  # attached, not started here: must leave it running
    client = HttpEngine(served.url)
    assert client.health() and client.health_generate()
    local = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir))
    assert [s.output_ids for s in client.generate(PROMPTS, PARAMS)] == [
        s.output_ids for s in local.generate(PROMPTS, PARAMS)
    ]


@pytest.mark.slow
def test_distributed_weight_update_from_trainer(served, tiny_dir):
    from transformers import Qwen2ForCausalLM

    client = HttpEngine(served.url)
    before = client.generate(PROMPTS, PARAMS)
    assert gap(tiny_dir, before) < 1e-4  # engine == the HF dir's model before the sync

    new = random_state_dict(tiny_dir, seed=99)
    new_model = Qwen2ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    new_model.load_state_dict(new)
    updater = DistributedWeightUpdater(
        [client], DistributedUpdateConfig(bucket_bytes=40_000, timeout_s=120, load_format="flattened_bucket")
    )
    updater.connect()
    try:
        updater.update(new.items(), weight_version="step-1")  # several flattened buckets
        after = client.generate(PROMPTS, PARAMS)
        assert all(s.weight_version == "step-1" for s in after)
        assert gap(new_model, after) < 1e-4  # engine == the trainer's new weights
        assert gap(tiny_dir, after) > 1e-2  # ...and no longer the old ones
        pre_sync_lp = [hf_logprobs(tiny_dir, s.prompt_ids, s.output_ids, 1.0) for s in after]
        assert (
            max(
                (a - torch.tensor(s.output_logprobs, dtype=torch.float64)).abs().max().item()
                for a, s in zip(pre_sync_lp, after)
            )
            > 1e-2
        )

        # Mismatched names and shapes: the engine lists them all, loads nothing, and the group lives on.
        bad = [
            ("model.norm.weight", torch.zeros(64)),
            ("lm_head.weight", torch.zeros(128, 63)),
            ("model.layers.7.mlp.up_proj.weight", torch.zeros(128, 64)),
        ]
        with pytest.raises(EngineError) as err:
            updater.update(bad, weight_version="bad")
        msg = str(err.value)
        assert "lm_head.weight: shape [128, 63] != model's [128, 64]" in msg
        assert "model.layers.7.mlp.up_proj.weight: no such weight in the model" in msg
        assert client.weight_version() == "step-1"
        assert gap(new_model, client.generate(PROMPTS, PARAMS)) < 1e-4

        # The engine drops the group behind the trainer's back: a quick error, no hang, then reconnect.
        client.request("POST", "/destroy_weights_update_group", {"group_name": updater.group_name})
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="abandoned"):
            updater.update(new.items())
        assert time.monotonic() - t0 < 30
        updater.connect()
        assert updater.group_name == "weight_update_group_1"

        # Per-tensor broadcasts (load_format null) back to the original weights.
        updater.load_format = None
        orig = Qwen2ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).state_dict()
        updater.update(orig.items(), weight_version="step-2")
        assert gap(tiny_dir, client.generate(PROMPTS, PARAMS)) < 1e-4
        # ...where a mismatch is received into scratch tensors, reported, and nothing is loaded.
        with pytest.raises(EngineError, match=r"lm_head.weight: shape \[128, 63\]"):
            updater.update(bad)
        # bfloat16 tensors (the trainer's usual dtype) go through scratch and are cast on load.
        updater.update([(k, v.to(torch.bfloat16)) for k, v in new.items()], weight_version="bf16")
        assert client.weight_version() == "bf16"
        assert gap(new_model, client.generate(PROMPTS, PARAMS)) > 1e-4  # rounded to bf16...
        bf16_model = Qwen2ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
        bf16_model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in new.items()})
        assert gap(bf16_model, client.generate(PROMPTS, PARAMS)) < 1e-4  # ...exactly
        updater.update(orig.items(), weight_version="default")  # leave the shared server as it started
    finally:
        updater.close()


@pytest.mark.slow
def test_an_engine_that_refuses_the_group_ends_the_wait_at_once(served, monkeypatch):
    """The engine answers that it cannot join (here: asked for nccl on a CPU server) while this rank hosts the
    rendezvous: connect raises with the engine's words in seconds, not after the whole timeout."""
    from megaopd.sync import distributed

    real = distributed.dist_group.init_custom_process_group
    monkeypatch.setattr(
        distributed.dist_group, "init_custom_process_group", lambda backend, *args, **kw: real("gloo", *args, **kw)
    )  # this rank hosts with gloo
    updater = DistributedWeightUpdater([HttpEngine(served.url)], DistributedUpdateConfig(timeout_s=60))
    updater.backend = "nccl"  # what the engines are asked for
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="refused to join.*backend 'nccl' needs a GPU"):
        updater.connect()
    assert time.monotonic() - t0 < 20 and updater.pg is None


_TRAINER = """
import sys
from megaopd.rollout.client import HttpEngine
from megaopd.sync.distributed import DistributedUpdateConfig, DistributedWeightUpdater
updater = DistributedWeightUpdater([HttpEngine(sys.argv[1])], DistributedUpdateConfig(timeout_s=60))
updater.connect()
print(updater.group_name)
updater.close()
"""


@pytest.mark.slow
def test_a_name_taken_in_the_engines_process_is_tried_again_under_another(tiny_dir):
    """A server sharing its process with something that holds a group of the default name (as an in-process
    server beside a trainer-side updater's abandoned group) refuses that name; a trainer in another process
    takes the next one at once instead of waiting out its timeout."""
    import subprocess
    import sys

    from torch.distributed.distributed_c10d import _world

    from megaopd.parallel import custom_group
    from megaopd.serving.server import RolloutServer, ServeConfig

    held = None  # an earlier test's abandoned group may hold the name here already
    if "weight_update_group" not in _world.pg_names.values():
        held = custom_group.init_custom_process_group(
            "gloo", "127.0.0.1", find_free_port(), 0, 1, "weight_update_group"
        )
    config = ServeConfig(hf_dir=tiny_dir, port=0)
    server = RolloutServer(config, engine=EmbeddedEngine(config.engine_config())).start()
    try:
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", _TRAINER, server.url], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split()[-1].startswith("weight_update_group_")
        assert time.monotonic() - t0 < 40
    finally:
        server.shutdown()
        if held is not None:
            custom_group.destroy_custom_process_group(held)


@pytest.mark.slow
def test_pool_over_servers_with_a_dead_one(served, tiny_dir):
    dead = HttpEngine(HttpEngineConfig(url=f"http://127.0.0.1:{find_free_port()}", retries=1, backoff_s=0.01))
    pool = EnginePool([dead, HttpEngine(served.url)], PoolConfig(recheck_failed=False))
    local = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir))
    got = pool.generate(PROMPTS, PARAMS)
    assert [s.output_ids for s in got] == [s.output_ids for s in local.generate(PROMPTS, PARAMS)]


@pytest.mark.slow
def test_pool_targets_take_a_group_and_prompt_logprobs(served, tiny_dir):
    from transformers import Qwen2ForCausalLM

    client = HttpEngine(served.url)
    pool = EnginePool([client])
    assert pool.weight_transports == ("dist_group", "cuda_ipc", "http_lora") and pool.weight_targets() == [client]
    transport = DistGroupTransport(pool.weight_targets(), DistributedUpdateConfig(timeout_s=60))
    orig = Qwen2ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).state_dict()
    try:
        transport.push(iter(orig.items()), weight_version="pool-1")  # a generator, as the trainer sends
        assert client.weight_version() == "pool-1"
        lps = pool.prompt_logprobs([5, 6, 7])
        ref = hf_logprobs(tiny_dir, [5], [6, 7], 1.0)
        assert lps[0] is None and max(abs(a - b) for a, b in zip(lps[1:], ref.tolist())) < 1e-4
    finally:
        transport.close()
        pool.close()
