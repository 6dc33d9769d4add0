"""Transport choice, the colocated GPU map and CUDA IPC payloads (built on CPU: the handles themselves
need GPUs), SGLang's weight-update sessions against `megaopd serve` acting as an old and a new server,
and the memory order of WeightSync.push (weights resumed before the sync, the KV cache after, nothing
that was never released)."""

import pytest
import torch

from megaopd.engine.config import EmbeddedEngineConfig
from megaopd.engine.memory import MemoryStateError
from megaopd.parallel.launch import spawn
from megaopd.rollout import build_engine
from megaopd.rollout.client import EngineRequestError, HttpEngine, HttpEngineConfig
from megaopd.rollout.config import RolloutConfig
from megaopd.rollout.embedded import EmbeddedEngine
from megaopd.rollout.pool import EnginePool
from megaopd.serving.server import RolloutServer, ServeConfig
from megaopd.sync import choose_transport
from megaopd.sync.cuda_ipc import CudaIpcTransport, IpcLayout, deserialize_named_tensors, feeder_ranks, tensor_request
from megaopd.sync.distributed import weight_update_sessions
from tests.engine._models import build_tiny_qwen2
from tests.sync import _workers


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), seed=0)


def test_transport_follows_engine_and_colocation(tiny_dir):
    embedded = build_engine(RolloutConfig(engine="embedded", max_batch_size=8), tiny_dir)
    assert embedded.config.max_batch_size == 8 and embedded.weight_targets() == [embedded]
    pool = build_engine(RolloutConfig(engine="remote", urls=["http://a:1", "http://b:2"], engine_tp=2), tiny_dir)
    assert [e.config.workers for e in pool.weight_targets()] == [2, 2]
    for e in pool.weight_targets():
        e._megaopd_serve = False  # SGLang servers (no server answers at these URLs: not asked)
    assert choose_transport(embedded.weight_transports, colocated=False) == "in_process"
    assert choose_transport(embedded.weight_transports, colocated=True) == "in_process"
    assert choose_transport(pool.weight_transports, colocated=False) == "dist_group"
    # Colocated HTTP engines: NCCL refuses a group with two ranks on one GPU, so CUDA IPC.
    assert choose_transport(pool.weight_transports, colocated=True) == "cuda_ipc"
    with pytest.raises(ValueError, match="rollout.colocated"):
        choose_transport(("dist_group",), colocated=True)


def test_feeder_ranks_map_engine_gpus_to_trainer_ranks():
    # Two nodes of 4 GPUs, one engine per node at TP 2 on GPUs 0-1: trainer ranks 0,1 and 4,5 feed them.
    assert feeder_ranks([(0, 2), (0, 2)], IpcLayout(local_world_size=4, world_size=8)) == [[0, 1], [4, 5]]
    # Two engines per node (GPUs 0-1 and 2-3).
    assert feeder_ranks([(0, 2), (2, 2)], IpcLayout(4, 4, engines_per_node=2)) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="not all among the node's 4"):
        feeder_ranks([(2, 4)], IpcLayout(4, 4))
    with pytest.raises(ValueError, match="only 1 node"):
        feeder_ranks([(0, 2), (0, 2)], IpcLayout(4, 4))


def test_cuda_ipc_payloads_name_every_tensor_per_tp_rank():
    bucket = [("model.norm.weight", torch.arange(4.0)), ("lm_head.weight", torch.ones(3, 2, dtype=torch.bfloat16))]
    engines = [HttpEngine(HttpEngineConfig(url="http://e0:1", workers=2))]
    t0 = CudaIpcTransport(engines, [[0, 1]], rank=0, device=torch.device("cpu"))
    t2 = CudaIpcTransport(None, [[0, 1]], rank=2, device=torch.device("cpu"))
    assert t2.payload(bucket) is None  # rank 2 shares no GPU with the engine
    text = t0.payload(bucket)
    got = deserialize_named_tensors(text)
    assert [n for n, _ in got] == [n for n, _ in bucket]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(got, bucket))
    bodies = t0.requests([text, "from-rank-1", None], last=False, weight_version="7")
    assert bodies == [tensor_request([text, "from-rank-1"], flush_cache=False, weight_version=None)]
    last = t0.requests([text, "from-rank-1", None], last=True, weight_version="7")[0]
    assert last["flush_cache"] is True and last["weight_version"] == "7" and last["load_format"] is None
    with pytest.raises(RuntimeError, match=r"ranks \[1\] sent no tensors"):
        t0.requests([text, None, None], last=True, weight_version="7")


@pytest.fixture(scope="module")
def servers(tiny_dir):
    """`megaopd serve` acting as SGLang 0.5.23 (weight-update sessions) and as 0.5.2 (none)."""
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir))
    new = RolloutServer(ServeConfig(hf_dir=tiny_dir, port=0, sglang_version="0.5.23"), engine=engine).start()
    old = RolloutServer(ServeConfig(hf_dir=tiny_dir, port=0, sglang_version="0.5.2"), engine=engine).start()
    yield new, old
    new.shutdown()
    old.shutdown()


def test_server_speaks_both_protocols_and_client_detects_them(servers):
    new, old = (HttpEngine(s.url) for s in servers)
    assert new.server_info()["version"] == "0.5.23" and new.server_version() == (0, 5, 23)
    assert old.request("GET", "/get_server_info")["version"] == "0.5.2" and old.server_version() == (0, 5, 2)
    # New protocol: updates outside a session are refused; one session at a time.
    body = {"serialized_named_tensors": ["eA=="], "load_format": None, "flush_cache": True}  # base64, as SGLang checks
    with pytest.raises(EngineRequestError, match="begin_weight_update") as err:
        new.request("POST", "/update_weights_from_tensor", body)
    assert err.value.status == 400
    assert new.begin_weight_update() is True
    with pytest.raises(EngineRequestError, match="already open"):
        new.begin_weight_update()
    with pytest.raises(EngineRequestError, match="CUDA IPC"):  # past the session check
        new.request("POST", "/update_weights_from_tensor", body)
    new.end_weight_update()
    with pytest.raises(EngineRequestError, match="no weight-update session"):
        new.end_weight_update()
    # Old protocol: no session endpoints (404), and the client does not ask for one.
    with pytest.raises(EngineRequestError) as err:
        old.request("POST", "/begin_weight_update", {"selector": "all"})
    assert err.value.status == 404
    assert old.begin_weight_update() is False
    with pytest.raises(EngineRequestError, match="CUDA IPC"):  # no session needed
        old.request("POST", "/update_weights_from_tensor", body)
    # A version-less server that turns out to lack the endpoints is remembered as sessionless.
    unknown = HttpEngine(servers[1].url)
    unknown._version = None
    assert unknown.begin_weight_update() is False and unknown._session_endpoints is False


def test_sessions_close_after_errors(servers):
    new = HttpEngine(servers[0].url)
    with pytest.raises(RuntimeError, match="boom"):
        with weight_update_sessions([new]):
            raise RuntimeError("boom")
    assert servers[0].weights.session is None  # closed, so the next update can open one
    with weight_update_sessions([new]) as s:
        assert s.opened == [new] and servers[0].weights.session == "all"
    assert servers[0].weights.session is None


def test_resume_needs_a_release(servers, tiny_dir):
    """Fault 3: resuming memory that was never released is refused everywhere (SGLang 0.5.23 dies on it)."""
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir))
    with pytest.raises(MemoryStateError, match=r"cannot resume \['weights'\]: not released"):
        engine.resume_memory(["weights"])
    engine.release_memory(["kv_cache"])
    with pytest.raises(MemoryStateError, match="weights"):
        engine.resume_memory()  # None = every tag, and weights were not released
    assert engine.released_tags == {"kv_cache"}
    engine.resume_memory(["kv_cache"])
    assert engine.released_tags == frozenset()
    # The client refuses before sending anything; the server refuses with HTTP 400.
    client = HttpEngine(servers[0].url)
    with pytest.raises(MemoryStateError, match="not released"):
        client.resume_memory(["weights"])
    with pytest.raises(EngineRequestError, match="not released") as err:
        client.request("POST", "/resume_memory_occupation", {"tags": ["cuda_graph"]})
    assert err.value.status == 400
    client.release_memory(["kv_cache", "cuda_graph"])
    assert client.released_tags == {"kv_cache", "cuda_graph"}
    pool = EnginePool([client])
    assert pool.released_tags == {"kv_cache", "cuda_graph"}
    pool.resume_memory(["kv_cache", "cuda_graph"])
    assert client.released_tags == frozenset() and client.health()


@pytest.mark.slow
def test_weight_sync_memory_order(tiny_dir):
    """WeightSync.push from a TP=2 actor into an embedded engine marked colocated: at start-up nothing is
    resumed; after a release, weights are resumed before the load and the KV cache / CUDA graphs after."""
    calls = spawn(_workers.push_and_record, 2, args=(tiny_dir,), timeout=600)[0]
    assert calls["startup"] == ["update_weights(v0)"]
    assert calls["after_release"] == ["resume(['weights'])", "update_weights(v1)", "resume(['kv_cache', 'cuda_graph'])"]
    assert calls["gap"] < 1e-4  # the engine now holds the actor's weights


def test_cuda_ipc_serializer_leaves_torchs_reductions_alone():
    """The payload pickler names GPUs by UUID in its own dispatch table. It used to apply SGLang's
    monkey_patch_torch_reductions, which swaps torch's reduce_tensor for the whole process and assumes a CUDA
    tensor: afterwards any CPU tensor pickled through torch.multiprocessing failed with IndexError."""
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    from megaopd.sync.cuda_ipc import _IpcPickler, _reduce_tensor_by_uuid, serialize_named_tensors

    before = reductions.reduce_tensor
    CudaIpcTransport(None, [[0]], rank=1, device=torch.device("cpu"))
    text = serialize_named_tensors([("w", torch.arange(3.0))])
    assert torch.equal(deserialize_named_tensors(text)[0][1], torch.arange(3.0))
    assert reductions.reduce_tensor is before
    assert ForkingPickler._extra_reducers[torch.Tensor] is before  # the process-wide table is torch's own
    assert _IpcPickler(io.BytesIO()).dispatch_table[torch.Tensor] is _reduce_tensor_by_uuid
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(torch.ones(2))  # what spawned workers' queues do
    assert torch.equal(pickle.loads(buf.getvalue()), torch.ones(2))
