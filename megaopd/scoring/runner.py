"""The one pipeline runner: a megatron model stage over micro-batches through megatron's schedule, any TP/PP.

    runner = PipelineRunner(model, pg_collection, vocab_size, partner=reference_model)
    results = runner.run(micro_batches, step_fn, forward_only=False)

Every scoring pass, the training step, `megaopd logprobs` and the parity probe run their models
through it. A micro-batch is any record with `tokens_BS` [b, S] (long) and `to(device)`; every
micro-batch of one run has the same [b, S] shape when PP > 1 (pipeline buffers are fixed-size). A record
whose `packed` attribute is a `megaopd.batching.packing.PackedRow` is one packed row [1, total] of several
sequences: the runner passes megatron's PackedSeqParams (THD, cu_seqlens) and per-sequence position ids, and
the model's core attention keeps every sequence to itself (models/packed_attention.py, or TE's). This is the one
place where micro-batches move to the model's device: `step_fn` receives the moved record, so every
tensor it reads (targets, masks, scores) sits beside the logits.

`step_fn(micro_batch, logits_BSv, partner_logits_BSv)` runs on the last pipeline stage with this rank's
vocab shard of the logits (megatron's vocab-padding columns masked) and returns (loss, result): loss is
backpropagated (forward_only=False), result is collected and returned in micro-batch order on the last
stage (None elsewhere). `partner` is a frozen model of the same layout (the reference, or the GKD
teacher) run in lockstep on the same tokens: its activations travel through the pipeline beside the
student's, concatenated along the batch dimension (on the last stage the two logits stay apart,
PairedLogits: no copy), so the exact full-vocabulary KL of a micro-batch needs the partner's logits of that
micro-batch only, never of the whole batch.

With `logits_chunk_tokens` > 0 the logits are not made at all: the models stop short of their output layer
(models/output_layer.py) and step_fn receives megaopd.ops.head.LogitsHead records (hidden states + the
vocabulary shard of the output weight, padding masked per chunk) in place of the logits tensors; every
per-token op reads them through ops.head.tokenwise, which makes the logits `logits_chunk_tokens` tokens at
a time in forward and again in backward. 0 keeps the model's output layer (whole [b, s, V/TP] logits).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_attr_wrapped_model

from megaopd.models import compat
from megaopd.models.output_layer import defer_output_layer, output_weight
from megaopd.models.vocab_padding import mask_vocab_padding
from megaopd.ops.head import LogitsHead


class MicroBatchLike(Protocol):
    tokens_BS: torch.Tensor

    def to(self, device: torch.device) -> "MicroBatchLike":
        """The same record with every tensor on `device`."""


M = TypeVar("M", bound=MicroBatchLike)
StepFn = Callable[[Any, torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, Any]]


class PairedLogits(NamedTuple):
    """The last stage's output of a lockstep pair: the two models' logits [b, s, v], each its own tensor."""

    student: torch.Tensor
    partner: torch.Tensor


class _LockstepPair(torch.nn.Module):
    """Student and a frozen partner of the same layout, run on the same micro-batch.

    Between pipeline stages the two hidden states travel as one tensor [s, 2b, h] (student rows
    first). On the last stage the logits stay apart (PairedLogits): megatron hands the last stage's
    output straight to the loss function, and concatenating two [b, s, v] logits would copy both (2x the
    student's logits, the largest tensors of the step) and, in backward, give the student's slice of the
    concatenation a zero-filled [2b, s, v] gradient. The partner runs without grad.
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

    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None):
        out = self.student(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)
        with torch.no_grad():
            partner_out = self.partner(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)
        if self._batch_dim == 0:  # last stage: logits, read by the loss function only
            return PairedLogits(out, partner_out)
        return torch.cat([out, partner_out], dim=self._batch_dim)


class PipelineRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pg_collection: ProcessGroupCollection,
        vocab_size: int,
        partner: torch.nn.Module | None = None,
        logits_chunk_tokens: int = 0,
    ):
        if logits_chunk_tokens < 0:
            raise ValueError(f"logits_chunk_tokens={logits_chunk_tokens} must be >= 0 (0: whole logits)")
        self.logits_chunk_tokens = logits_chunk_tokens
        """Tokens per chunk of the fused output layer + loss (0: the model makes the whole logits)."""
        self.model = model
        self.pgs = pg_collection
        self.vocab_size = vocab_size
        """Real vocabulary size: logit columns at or past it are masked (padding, or ids the other model lacks)."""
        self.partner = partner
        self._schedule = compat.forward_backward_func(pg_collection)
        self.is_last_stage = pg_collection.pp.rank() == pg_collection.pp.size() - 1
        # Sequence parallelism splits the token dimension over TP: packed rows are padded to a multiple of it.
        sp = getattr(get_attr_wrapped_model(model, "config"), "sequence_parallel", False)
        self.seq_multiple = pg_collection.tp.size() if sp else 1
        # Expert parallelism exchanges tokens among the EP ranks in every MoE layer, so they must run
        # micro-batches of one shape in lockstep: an EP > 1 model takes the padded path, never packed rows.
        ep = getattr(pg_collection, "ep", None)
        self.packs = ep is None or ep.size() == 1

    def run(self, micro_batches: Sequence[M], step_fn: StepFn, forward_only: bool) -> list[Any] | None:
        """Runs every micro-batch; returns step_fn's results in order on the last pipeline stage, None on
        the others."""
        if not micro_batches:
            return [] if self.is_last_stage else None
        b, S = micro_batches[0].tokens_BS.shape
        packed = getattr(micro_batches[0], "packed", None) is not None
        if any((getattr(mb, "packed", None) is not None) != packed for mb in micro_batches):
            raise ValueError("a run's micro-batches must be all packed or all padded")
        if packed:
            S = max(mb.tokens_BS.shape[1] for mb in micro_batches)
        if (not packed or self.pgs.pp.size() > 1) and any(tuple(mb.tokens_BS.shape) != (b, S) for mb in micro_batches):
            raise ValueError(
                "all micro-batches of one run must have the same [b, S] shape (pad them; packed rows "
                "to one token count when PP > 1: pipeline buffers are fixed-size)"
            )
        if any(mb.tokens_BS.shape[1] % self.seq_multiple for mb in micro_batches):
            raise ValueError(
                f"sequence parallelism splits tokens over TP={self.seq_multiple}: micro-batch lengths "
                f"must be multiples of it; use trainer.pack_sequences=true (packed rows are padded to "
                f"it) or sequence_parallel=false"
            )
        module = self.model if self.partner is None else _LockstepPair(self.model, self.partner)
        paired = self.partner is not None
        device = next(self.model.parameters()).device
        data = iter(micro_batches)

        def forward_step(data_iterator, model):
            mb = next(data_iterator).to(device)
            if packed:
                output = model(
                    mb.tokens_BS,
                    mb.packed.position_ids().to(device),
                    None,
                    packed_seq_params=_packed_seq_params(mb.packed, device),
                )
            else:
                position_ids = torch.arange(S, device=device).unsqueeze(0).expand(b, S)
                output = model(mb.tokens_BS, position_ids, None)  # causal mask from the layer spec

            def loss_func(output_tensor):
                student, partner = output_tensor if paired else (output_tensor, None)
                if self.logits_chunk_tokens:  # hidden states [b, s, H]: the logits are made chunk by chunk
                    student, partner = self._head(self.model, student), self._head(self.partner, partner)
                    loss, result = step_fn(mb, student, partner)
                    return loss, torch.ones((), dtype=torch.int, device=device), {"result": result}
                # In place: megatron's schedule holds the model's output through the loss, so a masked copy
                # would be a second logits-sized tensor per model.
                student = mask_vocab_padding(student, self.vocab_size, self.pgs.tp, inplace=True)
                partner = mask_vocab_padding(partner, self.vocab_size, self.pgs.tp, inplace=True) if paired else None
                loss, result = step_fn(mb, student, partner)
                # calculate_per_token_loss semantics: the schedule neither divides the loss nor
                # (with our finalize hook) rescales the gradients; losses divide by global counts.
                return loss, torch.ones((), dtype=torch.int, device=device), {"result": result}

            return output, loss_func

        deferred = (
            defer_output_layer(self.model, self.partner) if self.logits_chunk_tokens else contextlib.nullcontext()
        )
        with deferred:
            results = self._schedule(
                module,
                forward_step_func=forward_step,
                data_iterator=data,
                num_microbatches=len(micro_batches),
                seq_length=S,
                micro_batch_size=2 * b if paired else b,
                forward_only=forward_only,
            )
        if not self.is_last_stage:
            return None
        return [r["result"] for r in results]

    def _head(self, model, hidden_BSH) -> LogitsHead | None:
        if hidden_BSH is None:
            return None
        return LogitsHead(hidden_BSH, output_weight(model), self.vocab_size, self.pgs.tp, self.logits_chunk_tokens)


def _packed_seq_params(row, device: torch.device) -> PackedSeqParams:
    """megatron's THD parameters of a packed row (self-attention: the same boundaries for q and kv)."""
    cu = row.cu_seqlens.to(device)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=row.max_seqlen, max_seqlen_kv=row.max_seqlen
    )


def broadcast_from_last_stage(value: torch.Tensor | None, shape, dtype, pp_group, device: torch.device) -> torch.Tensor:
    """The last pipeline stage's tensor, on every rank of the PP group (allocated on `device`, the
    group's device: CUDA under NCCL)."""
    if pp_group.size() == 1:
        return value
    src = dist.get_global_rank(pp_group, pp_group.size() - 1)
    value = torch.empty(shape, dtype=dtype, device=device) if value is None else value.to(device).contiguous()
    dist.broadcast(value, src=src, group=pp_group)
    return value
