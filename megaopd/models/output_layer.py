"""The model stopped short of its output layer, for the fused output layer + loss (megaopd.ops.head).

    with defer_output_layer(model):                 # the forward returns hidden states [b, s, H]
        hidden_BSH = model(tokens, positions, None)
    head = LogitsHead(hidden_BSH, output_weight(model), vocab_size, tp_group, chunk_tokens)

megatron's GPTModel multiplies the final hidden states by the output weight (ColumnParallelLinear) and
returns logits [b, s, V/TP]. Deferred, the output layer does only its tensor-parallel region op (identity
forward and all-reduce of the input gradient backward; under sequence parallelism the all-gather forward
and reduce-scatter backward) and hands the hidden states through: GPTModel's own `transpose(0, 1)` then
makes them [b, s, H]. The loss multiplies them by the weight chunk by chunk, so the whole micro-batch's
logits are never made, and the gradients it returns to the hidden states go through the same region op
as the output layer's would. The weight stays the model's parameter (tied to the embedding or not), so
DDP, the optimizer and checkpoints see nothing new.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.utils import get_attr_wrapped_model


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward, all-reduce of the input gradient over TP backward: megatron's
    copy_to_tensor_model_parallel_region, except that it reduces a contiguous copy and returns it. megatron's
    reduces `grad.contiguous()` in place and returns `grad`, which is a no-op when the gradient is a
    transposed view, as it is here (GPTModel's transpose(0, 1) sits between this op and the loss)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _deferred_forward(layer):
    def forward(input_, weight=None, runtime_gather_output=None):
        group = layer.tp_group
        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=group)
        elif group.size() > 1:
            hidden = _AllReduceGrad.apply(input_, group)
        else:
            hidden = input_
        return hidden, None

    return forward


@contextlib.contextmanager
def defer_output_layer(*models: torch.nn.Module):
    """Within the block, each model's forward (on its last pipeline stage) returns the output layer's input
    [b, s, H] instead of logits. Models without an output layer on this stage are left as they are."""
    layers = []
    for model in models:
        if model is None or not get_attr_wrapped_model(model, "post_process"):
            continue
        layer = get_attr_wrapped_model(model, "output_layer")
        if any(layer is seen for seen in layers):  # a LoRA student and its BaseView share one output layer
            continue
        layer.forward = _deferred_forward(layer)  # instance attribute: nn.Module.__call__ finds it first
        layers.append(layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """This rank's vocabulary shard of the output weight [V/TP, H], as GPTModel passes it to its output
    layer: the embedding's weight when they are tied, else the output layer's own."""
    if get_attr_wrapped_model(model, "share_embeddings_and_output_weights"):
        return get_attr_wrapped_model(model, "shared_embedding_or_output_weight")()
    return get_attr_wrapped_model(model, "output_layer").weight
