"""Megatron's padded vocabulary columns must vanish from every softmax, also at temperature < 1.

Regression: padding at the dtype's lowest value overflowed to -inf once divided by a temperature below 1,
and 0 * -inf made entropy, KL and their gradients NaN."""

import pytest
import torch

from megaopd import ops
from megaopd.models.vocab_padding import mask_vocab_padding


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.3])
def test_masked_padding_is_finite_and_has_no_mass(temperature):
    torch.manual_seed(0)
    real = 10
    logits = (torch.randn(3, 4, 16) * 5).requires_grad_(True)  # 16 columns, the last 6 are padding
    masked = mask_vocab_padding(logits, real)
    other = mask_vocab_padding(torch.randn(3, 4, 16), real)
    lp = ops.vocab_parallel_logprobs(masked, torch.randint(0, real, (3, 4)), temperature=temperature)
    ent = ops.vocab_parallel_entropy(masked, temperature=temperature)
    kl = ops.vocab_parallel_kl(masked, other, temperature=temperature)
    (lp.sum() + ent.sum() + kl.sum()).backward()
    for t in (lp, ent, kl, logits.grad):
        assert torch.isfinite(t).all()
    assert logits.grad[..., real:].abs().max() == 0  # no gradient reaches a column that is not a token
    # The same quantities over the real vocabulary alone (the reference).
    ref = torch.log_softmax(logits.detach()[..., :real].double() / temperature, -1)
    assert torch.allclose(ent.double(), -(ref.exp() * ref).sum(-1), atol=1e-5)


def test_in_place_mask_gives_the_same_values_and_gradients():
    """The runner masks the model's output in place (no second logits-sized tensor): same logits, same
    gradient, none at padding columns, through a non-leaf like the output layer's."""
    torch.manual_seed(0)
    real, ids = 10, torch.randint(0, 10, (3, 4))
    w = torch.randn(8, 16, requires_grad=True)
    h = torch.randn(3, 4, 8)
    grads, values = [], []
    for inplace in (False, True):
        logits = (h.transpose(0, 1) @ w).transpose(0, 1)  # a non-leaf view, as megatron's [s, b] -> [b, s] output
        masked = mask_vocab_padding(logits, real, inplace=inplace)
        assert (masked is logits) == inplace
        loss = ops.vocab_parallel_logprobs(masked, ids).sum() + ops.vocab_parallel_entropy(masked).sum()
        grads.append(torch.autograd.grad(loss, w)[0])
        values.append(masked.detach().clone())
        assert masked[..., real:].max() < -1e29
    assert torch.equal(values[0], values[1])
    assert torch.equal(grads[0], grads[1])
