"""The logits' memory of a scoring pass and of a training micro-batch, in units of L (one bf16 logits tensor
of the micro-batch), measured with torch's CPU allocation events (benchmarks/memory.py, whose README table
is the same measurement at 2048 tokens): 1.04L, 2.01L and 2.21L. Each copy a change could bring back adds
about 1L (a float32 copy, a masked copy of the vocabulary padding, concatenated lockstep logits, a separate
gradient buffer), which is what the bounds catch. The model's own output is 1L (2L for padded rows:
megatron's [S, b] -> [b, S] copy), the training step's 2L (the student's logits and the reference's, which
take the gradient)."""

import pytest

from benchmarks.memory import measure


@pytest.mark.slow
def test_logits_memory_in_units_of_one_logits_tensor():
    vocab, tokens = 31900, 512  # megatron pads 31900 to 32000 columns: the padding mask is exercised too
    L = tokens * vocab * 2
    peak = {k: v / L for k, v in measure(vocab, tokens, seqs=8, chunk_mib=0.25, time_reps=0).items()}
    assert peak["score, packed"] < 1.5, peak
    assert peak["score, padded"] < 2.5, peak
    assert peak["train, packed"] < 2.8, peak
    # The fused output layer (logits 32 tokens at a time, the share 1024 is of 16k): no L is ever made; what
    # is left is chunks, the output weight's float32 gradient ([V, h]: 0.25L at this tiny h=64 and 512
    # tokens) and the model's activations.
    fused = {k: v / L for k, v in measure(vocab, tokens, seqs=8, chunk_mib=0.25, chunk_tokens=32, time_reps=0).items()}
    for case in peak:
        assert fused[case] < 0.6 * peak[case], (case, fused[case], peak[case])
