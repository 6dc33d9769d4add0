"""The embedded engine as the trainer sees it: the Engine protocol (megaopd.rollout.protocol) over the
model runner of megaopd.engine, in this process. The CPU default engine (GPU when present).

    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir="path/to/hf"))
    samples = engine.generate([[1, 2, 3]], SamplingParams(n=4, max_new_tokens=32, seed=0))
    engine.update_weights(actor_hf_named_tensors, weight_version="step-7")
    engine.update_adapter_weights(peft_named_lora_tensors, rank=16, alpha=32, weight_version="step-8")  # LoRA

What this adds to the runner is the protocol's vocabulary: prompts x n become rows with their seeds
(protocol.expand_samples) and sampling settings (row_request, which `megaopd serve` uses too), results
become Samples, and weights arrive "in_process" (megaopd.sync.in_process). Everything else (generation,
prompt scores, weight loads, memory release) is the runner's: megaopd.engine.runner.
"""

from __future__ import annotations

from typing import Iterable

from megaopd.engine.lora import AdapterUpdate
from megaopd.engine.rows import RowRequest
from megaopd.engine.runner import ModelRunner
from megaopd.rollout.protocol import Sample, SampleRequest, SamplingParams, expand_samples
from megaopd.rollout.schema import ParsedParams


def row_request(sample: SampleRequest, params: SamplingParams | ParsedParams, eos_ids: Iterable[int]) -> RowRequest:
    """The runner's row for one sample: its prompt and seed, the sampling settings of params, and the ids
    that stop it (EOS and stop_token_ids). params: the trainer's SamplingParams, or a server request's
    ParsedParams (the same fields; max_new_tokens may be 0 there: prefill scoring runs no row)."""
    # SGLang 0.5.23: ignore_eos ignores stop_token_ids too (the response runs to its budget).
    stop = set() if params.ignore_eos else set(params.stop_token_ids) | set(eos_ids)
    return RowRequest(
        prompt_ids=list(sample.prompt_ids),
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        stop_ids=frozenset(stop),
        seed=sample.seed,
    )


class EmbeddedEngine(ModelRunner):
    """The runner as an Engine; see the module docstring."""

    weight_transports = ("in_process",)
    """It loads HF-named tensors handed to update_weights in this process (megaopd.sync.in_process)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, first_prompt_index: int = 0) -> list[Sample]:
        rows = [
            row_request(s, params, self.eos_ids)
            for s in expand_samples(prompts, params.n, params.seed, first_prompt_index)
        ]
        results = self.run(rows)
        return [
            Sample(
                prompt_ids=list(r.prompt_ids),
                output_ids=o.output_ids,
                output_logprobs=o.logprobs,
                finish_reason=o.finish_reason,
                weight_version=o.weight_version,
            )
            for r, o in zip(rows, results)
        ]

    def update_adapter_weights(
        self, named_tensors: Iterable[tuple[str, object]], rank: int, alpha: float, weight_version: str | None = None
    ) -> None:
        """A LoRA adapter sync (megaopd.sync.in_process, rollout.lora_sync=adapter): peft-named lora_A / lora_B
        tensors, checked (AdapterUpdate.of: every problem in one error, nothing loaded) and merged into the base
        weights this engine keeps (ModelRunner.update_adapter). The runner's update_adapter takes the checked
        record; this is the transports' vocabulary, as update_weights is for full weights."""
        version = self.weight_version if weight_version is None else str(weight_version)
        self.update_adapter(AdapterUpdate.of(named_tensors, rank, alpha, version))

    def weight_targets(self) -> list["EmbeddedEngine"]:
        return [self]
