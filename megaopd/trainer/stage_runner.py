"""Runs a megatron model stage over micro-batches through megatron's pipeline schedule, any TP/PP.

    runner = StageRunner(model, pg_collection, vocab_size, partner=reference_model)
    outputs = runner.run(micro_batches, step_fn, forward_only=False)

`step_fn(micro_batch, logits_BSv, partner_logits_BSv)` runs on the last pipeline stage with this
rank's vocab shard of the logits (padding columns of the vocabulary masked out) and returns
(loss, result): loss is backpropagated (forward_only=False), result is collected and returned on the
last stage (None elsewhere). `partner` is a frozen model of the same layout (the reference) run in
lockstep on the same tokens: its activations travel through the pipeline beside the student's,
concatenated along the batch dimension, so the exact full-vocabulary KL of a micro-batch needs the
reference logits of that micro-batch only, never of the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_attr_wrapped_model

from megaopd.models import compat
from megaopd.models.logprobs import mask_vocab_padding

class _LockstepPair(torch.nn.Module):
    """Student and a frozen partner of the same layout, run on the same micro-batch.

    Between pipeline stages the two hidden states travel as one tensor [s, 2b, h] (student rows
    first); on the last stage the logits come out as [2b, s, v]. The partner runs without grad.
    """

    def __init__(self, student: torch.nn.Module, partner: torch.nn.Module):
        super().__init__()
        self.student = student  # may be DDP-wrapped: attributes are read from the GPTModel inside
        self.partner = partner
        self.config = student.config
        self.model_type = get_attr_wrapped_model(student, "model_type")
        self._set_student_input = get_attr_wrapped_model(student, "set_input_tensor")
        self._set_partner_input = get_attr_wrapped_model(partner, "set_input_tensor")
        # Last stage: logits [b, s, v] (batch-first). Other stages: hidden [s, b, h] (batch second).
        self._batch_dim = 0 if get_attr_wrapped_model(student, "post_process") else 1

    def set_input_tensor(self, input_tensor):
        t = input_tensor[0] if isinstance(input_tensor, list) else input_tensor
        if t is None:
            self._set_student_input(None)
            self._set_partner_input(None)
            return
        half = t.shape[1] // 2
        self._set_student_input(t[:, :half])
        self._set_partner_input(t[:, half:].detach())

    def forward(self, input_ids, position_ids, attention_mask):
        out = self.student(input_ids, position_ids, attention_mask)
        with torch.no_grad():
            partner_out = self.partner(input_ids, position_ids, attention_mask)
        return torch.cat([out, partner_out], dim=self._batch_dim)


@dataclass
class MicroBatch:
    tokens_BS: torch.Tensor
    index: int
    """Position of the micro-batch in the list given to run(); step_fn uses it to find its data."""


class StageRunner:
    def __init__(self, model: torch.nn.Module, pg_collection: ProcessGroupCollection, vocab_size: int,
                 partner: torch.nn.Module | None = None):
        self.model = model
        self.pgs = pg_collection
        self.vocab_size = vocab_size
        self.partner = partner
        self._schedule = compat.forward_backward_func(pg_collection)
        self.is_last_stage = pg_collection.pp.rank() == pg_collection.pp.size() - 1

    def run(self, micro_batches: list[torch.Tensor], step_fn: Callable[..., tuple[torch.Tensor, Any]],
            forward_only: bool) -> list[Any] | None:
        """Runs every micro-batch (each [b, S], all the same shape); returns step_fn results in order on the
        last pipeline stage, None on the others."""
        if not micro_batches:
            return [] if self.is_last_stage else None
        b, S = micro_batches[0].shape
        if any(mb.shape != (b, S) for mb in micro_batches):
            raise ValueError("all micro-batches of one run must have the same [b, S] shape (pad them)")
        module = self.model if self.partner is None else _LockstepPair(self.model, self.partner)
        paired = self.partner is not None
        data = iter([MicroBatch(mb, i) for i, mb in enumerate(micro_batches)])

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            tokens = mb.tokens_BS.to(_device_of(model))
            position_ids = torch.arange(S, device=tokens.device).unsqueeze(0).expand(b, S)
            output = model(tokens, position_ids, None)

            def loss_func(output_tensor):
                logits = mask_vocab_padding(output_tensor, self.vocab_size, self.pgs.tp)
                student, partner = (logits[:b], logits[b:]) if paired else (logits, None)
                loss, result = step_fn(mb, student, partner)
                # calculate_per_token_loss semantics: the schedule neither divides the loss nor
                # (with our finalize hook) rescales the gradients; losses divide by global counts.
                return loss, torch.tensor(1, dtype=torch.int), {"result": result}

            return output, loss_func

        results = self._schedule(
            module, forward_step_func=forward_step, data_iterator=data, num_microbatches=len(micro_batches),
            seq_length=S, micro_batch_size=2 * b if paired else b, forward_only=forward_only)
        if not self.is_last_stage:
            return None
        return [r["result"] for r in results]


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def broadcast_from_last_stage(value: torch.Tensor | None, shape, dtype, pp_group) -> torch.Tensor:
    """The last pipeline stage's tensor, on every rank of the PP group."""
    if pp_group.size() == 1:
        return value
    src = dist.get_global_rank(pp_group, pp_group.size() - 1)
    value = torch.empty(shape, dtype=dtype) if value is None else value.contiguous()
    dist.broadcast(value, src=src, group=pp_group)
    return value
