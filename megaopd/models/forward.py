"""Forward-only passes of a (possibly pipelined) GPTModel through megatron's pipeline schedule.

    results = forward_only(model, micro_batches, pg_collection, on_logits)

Every rank of the model's layout calls it with the same micro-batches. Each stage runs its layers and
the schedule sends activations between stages; on the last stage `on_logits(logits_shard, batch)` gets
the vocab-sharded logits [b, s, Vp/tp] of each micro-batch, and forward_only returns its results in
micro-batch order (other stages get []). `on_logits` may run TP collectives: all TP ranks of the last
stage call it in lockstep. Works on CPU with gloo (see megaopd.parallel.cpu_compat).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from megaopd.models import compat


def forward_only(model, micro_batches: Sequence[dict], pg_collection=None,
                 on_logits: Callable[[torch.Tensor, dict], Any] | None = None) -> list[Any]:
    """micro_batches: dicts with "input_ids" [b, s] (one b and s for all: PP buffers are fixed-size)
    and optionally "position_ids" [b, s]. Returns on_logits' results (default: the logits shards)."""
    if not micro_batches:
        return []
    b, s = micro_batches[0]["input_ids"].shape
    for mb in micro_batches:
        if tuple(mb["input_ids"].shape) != (b, s):
            raise ValueError(f"micro-batches must share one shape for the pipeline; got {tuple(mb['input_ids'].shape)}"
                             f" after {(b, s)}: pad them to a common length")
    pgs = compat.resolve_pg_collection(pg_collection)
    on_logits = on_logits or (lambda logits, batch: logits)
    device = next(model.parameters()).device

    def step(data_iterator, model_chunk):
        batch = next(data_iterator)
        ids = batch["input_ids"].to(device)
        pos = batch.get("position_ids")
        pos = torch.arange(s, device=device).expand(b, s) if pos is None else pos.to(device)
        output = model_chunk(ids, pos, attention_mask=None)  # causal mask from the layer spec

        def collect(out, non_loss_data=False):
            return on_logits(out, batch)

        return output, collect

    run = compat.forward_backward_func(pgs)
    with torch.no_grad():
        results = run(model, forward_step_func=step, data_iterator=iter(micro_batches),
                      num_microbatches=len(micro_batches), seq_length=s, micro_batch_size=b,
                      forward_only=True, collect_non_loss_data=True)
    return list(results) if pgs.pp.rank() == pgs.pp.size() - 1 else []
