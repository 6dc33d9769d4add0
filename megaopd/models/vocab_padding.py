"""Megatron pads the vocabulary (embedding and output layer) to a multiple of 128 * TP; the padding
columns are not tokens. HF and SGLang normalize over the real vocabulary only, so every softmax over
megatron's logits masks them first (the ops take no vocabulary size).

    logits_BSv = mask_vocab_padding(logits_BSv, vocab_size, tp_group)

The mask lives in megaopd.ops.head, which also applies it to each chunk of logits it makes from hidden
states (the fused output layer); it is re-exported here for the model-side callers.

Legend: B batch, S sequence, v this rank's vocab shard width.
"""

from __future__ import annotations

from megaopd.ops.head import PAD_LOGIT, mask_vocab_padding

__all__ = ["PAD_LOGIT", "mask_vocab_padding"]
