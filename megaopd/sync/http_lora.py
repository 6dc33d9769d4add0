"""Transport "http_lora": `megaopd serve` engines take full weights over the weight-update group (the dist_group
transport, unchanged) and a LoRA student's adapters alone through POST /load_lora_adapter.

    t = HttpLoraTransport(DistGroupTransport([engine], DistributedUpdateConfig(...)))
    t.push(hf_named_base_weights, weight_version="0")      # the first sync: the base, over the group
    t.push_adapter(peft_named_adapter, AdapterMeta(rank=16, alpha=32.0), weight_version="1")   # every later one

An adapter update is the two files of a peft adapter folder carried in the request body (adapter_config as JSON,
adapter_model.safetensors as base64): the route's other form reads the same files from a folder under the
server's allowed roots, which would need a filesystem shared with the trainer; in the body it needs nothing but
the connection the trainer already has, and the server's key and body limit (--max-body-mb, 64 MiB: an adapter of
about 48 MiB of tensors, base64 being 4/3 of its bytes) hold as for every request. The server merges it into the
base it keeps (W_base + (alpha / r) B A, float32) and lora_name, the weight version, becomes its version.

Engines that accept it: `megaopd serve` (megaopd.rollout.client.HttpEngine.weight_transports asks GET /server_info).
SGLang 0.5.23's LoRA routes need a GPU on this build (docs/engines.md): its engines take the merged weights.
"""

from __future__ import annotations

import base64
from typing import Iterable

import torch

from megaopd.rollout.client import EngineRequestError, HttpEngine
from megaopd.sync import distributed
from megaopd.sync.distributed import DistGroupTransport
from megaopd.sync.transport import AdapterMeta, TransportKind, TransportSetup


class HttpLoraTransport:
    name = "http_lora"
    all_ranks = False
    """Only trainer rank 0 sends (the gather already brought every tensor there)."""

    def __init__(self, full: DistGroupTransport, timeout_s: float = 600.0):
        """full: the weight-update group to the engines (their full weights); timeout_s: longest wait for one
        engine to load an adapter (rollout.request_timeout_s)."""
        self.full, self.timeout_s = full, timeout_s
        self.engines: list[HttpEngine] = full.updater.engines

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        self.full.push(named_tensors, weight_version)

    def push_adapter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], meta: AdapterMeta, weight_version: str | None
    ) -> None:
        body = adapter_request(named_tensors, meta, weight_version)
        for engine in self.engines:
            try:
                # Idempotent (the same adapter merged into the same base): the client's retries are safe.
                engine.request("POST", "/load_lora_adapter", body, timeout_s=self.timeout_s)
            except EngineRequestError as e:
                if e.status == 413:
                    raise EngineRequestError(
                        f"{e} (an adapter of {len(body['adapter_model']) >> 20} MiB as base64): start megaopd serve "
                        "with a larger --max-body-mb, or set rollout.lora_sync=merged",
                        e.status,
                        e.body,
                    ) from None
                raise

    def close(self) -> None:
        self.full.close()


def adapter_request(
    named_tensors: Iterable[tuple[str, torch.Tensor]], meta: AdapterMeta, weight_version: str | None
) -> dict:
    """The body of POST /load_lora_adapter for peft-named adapter tensors: peft's adapter_config (the server reads
    peft_type, r, lora_alpha) and the safetensors bytes, base64."""
    from safetensors.torch import save

    tensors = {n: t.detach().to("cpu").contiguous() for n, t in named_tensors}
    return {
        "lora_name": "lora" if weight_version is None else str(weight_version),
        "adapter_config": {"peft_type": "LORA", "r": meta.rank, "lora_alpha": meta.alpha},
        "adapter_model": base64.b64encode(save(tensors)).decode("ascii"),
    }


def _build(setup: TransportSetup) -> HttpLoraTransport:
    return HttpLoraTransport(distributed.KIND.build(setup), timeout_s=setup.rollout.request_timeout_s)


KIND = TransportKind("http_lora", _build, colocated=False, adapters=True)
"""`megaopd serve` engines on their own devices (the full weights go as dist_group's)."""
