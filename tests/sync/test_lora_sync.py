"""A LoRA student's weight sync into the embedded engine (megaopd.sync.WeightSync, rollout.lora_sync): the adapters
alone (after the base, on the first push) or every weight merged. Either way the engine's log-probs equal the
actor's after each of two pushes (float32, < 1e-4: the parity bound), at TP=1 and TP=2 (2 gloo workers); a steady
adapter push sends about 10% of a merged one on the tiny model (rank 4 on all linears, hidden 64; at 7B, rank 16:
about 1%). The settings a job cannot run are refused at load (tests/config covers the messages).

    pytest tests/sync/test_lora_sync.py
"""

import pytest
import torch

from megaopd.parallel.launch import spawn
from tests.sync import _workers
from tests.trainer.tiny_models import make_tiny_pair


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return make_tiny_pair(str(tmp_path_factory.mktemp("lora_sync")))[0]


@pytest.mark.slow
@pytest.mark.parametrize("tp", (1, 2))
def test_lora_sync_parity_both_modes(student, tp):
    got = {}
    for mode in ("adapter", "merged"):
        got[mode] = spawn(_workers.lora_actor_to_embedded, 2, args=(student, tp, mode), timeout=600)[0]
        for push in got[mode]:
            assert push["gap"] < 1e-4, (mode, tp, push)
    first, steady = got["adapter"]
    merged = got["merged"][1]["bytes"]
    assert first["adapter_bytes"] > 0 and first["bytes"] == merged + first["adapter_bytes"]  # base, then adapter
    assert steady["bytes"] == steady["adapter_bytes"] < merged / 5
    assert [p["adapter_bytes"] for p in got["merged"]] == [0, 0]
    assert [p["version"] for p in got["adapter"]] == ["1", "2"]


def test_adapter_sync_needs_transports_that_take_adapters():
    """Only kinds marked `adapters` (in_process, http_lora) take rollout.lora_sync=adapter; an engine that takes
    full weights only (SGLang: dist_group) is refused in one line naming the engine and the fix, before anything
    is sent; auto sends adapters where every engine takes them, merged weights otherwise."""
    from megaopd.rollout.config import RolloutConfig
    from megaopd.sync import WeightSync
    from megaopd.sync.weight_sync import TRANSPORT_KINDS

    assert [k.name for k in TRANSPORT_KINDS.values() if k.adapters] == ["in_process", "http_lora"]

    class Target:
        def __init__(self, transports, url):
            self.weight_transports, self.url = transports, url

    class Engine:
        def __init__(self, *targets):
            self.targets = list(targets)

        def weight_targets(self):
            return self.targets

    serve, sglang = ("dist_group", "cuda_ipc", "http_lora"), ("dist_group", "cuda_ipc")

    def choice(lora_sync, *accepted, lora=True):
        engine = Engine(*(Target(a, f"http://e{i}") for i, a in enumerate(accepted)))
        groups, adapters = WeightSync(engine, RolloutConfig(lora_sync=lora_sync), 0)._targets_by_transport(lora)
        return sorted(groups), adapters

    assert choice("adapter", ("in_process",)) == (["in_process"], True)
    assert choice("adapter", serve) == (["http_lora"], True)
    assert choice("auto", serve, serve) == (["http_lora"], True)
    assert choice("auto", serve, lora=False) == (["dist_group"], False)  # a LoRA-less student: as before
    assert choice("merged", serve) == (["dist_group"], False)
    assert choice("auto", sglang) == (["dist_group"], False)
    assert choice("auto", serve, sglang) == (["dist_group"], False)  # one group, merged weights, for both
    with pytest.raises(ValueError) as e:
        choice("adapter", serve, sglang)
    assert "rollout.lora_sync=adapter: http://e1 takes full weights only" in str(e.value)
    assert "set rollout.lora_sync=merged" in str(e.value) and "\n" not in str(e.value)


def test_adapters_reach_megaopd_serve_through_its_route(tmp_path):
    """The http_lora transport's adapter push to a real `megaopd serve` (in-process): the served log-probs equal an
    HF model holding W + (alpha / r) B A (float64 merge, < 1e-4), the version is the adapter's name, a zero adapter
    brings the base back, and an adapter over the server's body limit is refused naming --max-body-mb."""
    from transformers import Qwen2ForCausalLM

    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.rollout.client import EngineRequestError, HttpEngine
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.rollout.protocol import SamplingParams
    from megaopd.serving.server import RolloutServer, ServeConfig
    from megaopd.sync.distributed import DistGroupTransport
    from megaopd.sync.http_lora import HttpLoraTransport
    from megaopd.sync.transport import AdapterMeta
    from tests.engine._models import build_tiny_qwen2, hf_logprobs

    hf_dir = build_tiny_qwen2(tmp_path / "tiny", seed=0)
    base = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(4)
    rank, alpha = 4, 8.0
    adapter, merged = [], {k: v.double() for k, v in base.state_dict().items()}
    for name, w in base.state_dict().items():
        if name.endswith(("q_proj.weight", "down_proj.weight")):
            a, b = torch.randn(rank, w.shape[1], generator=gen), torch.randn(w.shape[0], rank, generator=gen) * 0.3
            stem = "base_model.model." + name[: -len("weight")]
            adapter += [(stem + "lora_A.weight", a), (stem + "lora_B.weight", b)]
            merged[name] = merged[name] + (alpha / rank) * (b.double() @ a.double())
    model = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.load_state_dict({k: v.float() for k, v in merged.items()})

    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=hf_dir, max_batch_size=4, load_tokenizer=False))
    server = RolloutServer(ServeConfig(hf_dir=hf_dir, port=0), engine=engine).start()
    small = RolloutServer(ServeConfig(hf_dir=hf_dir, port=0, max_body_bytes=4096), engine=engine).start()
    try:
        client = HttpEngine(server.url)
        assert "http_lora" in client.weight_transports  # megaopd serve says so in its server info
        params = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=3)
        prompts = [[5, 6, 7], [8, 9, 10, 11]]

        def gap(reference):
            return max(
                (hf_logprobs(reference, s.prompt_ids, s.output_ids, 1.0) - torch.tensor(s.output_logprobs)).abs().max()
                for s in client.generate(prompts, params)
            ).item()

        transport = HttpLoraTransport(DistGroupTransport([client]))
        transport.push_adapter(adapter, AdapterMeta(rank, alpha), weight_version="7")
        assert client.weight_version() == "7"
        assert gap(model) < 1e-4 and gap(base) > 1e-2
        zero = [(n, t if "lora_A" in n else torch.zeros_like(t)) for n, t in adapter]
        transport.push_adapter(zero, AdapterMeta(rank, alpha), weight_version="8")
        assert gap(base) < 1e-4

        too_big = HttpLoraTransport(DistGroupTransport([HttpEngine(small.url)]))
        with pytest.raises(EngineRequestError, match="HTTP 413.*larger --max-body-mb, or set rollout.lora_sync=merged"):
            too_big.push_adapter(adapter, AdapterMeta(rank, alpha), weight_version="9")
        assert client.weight_version() == "8"
    finally:
        server.shutdown()
        small.shutdown()
