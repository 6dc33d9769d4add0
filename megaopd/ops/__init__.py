"""megaopd.ops: vocab-parallel primitives on TP-sharded logits, never gathering the vocabulary.

Every op takes the local logits shard [..., V/TP] (any leading shape; rank r owns global ids
[r*V/TP, (r+1)*V/TP), megatron's convention) and the TP process group (`group=None`: one process
holding the whole vocabulary). Results are float32 and identical on every rank of the group; tokens
are processed `chunk_size` at a time, and backward passes recompute the softmax chunk by chunk from
the logits and small per-token stats instead of saving it. Ops are per-token: callers mask.

    vocab_parallel_logprobs(logits, ids, group=None, temperature=1.0, chunk_size=None) -> [...]
    vocab_parallel_logsumexp(logits, group=None, temperature=1.0, chunk_size=None) -> [...]
    vocab_parallel_entropy(logits, group=None, temperature=1.0, chunk_size=None) -> [...]
    vocab_parallel_kl(logits_p, logits_q, group=None, temperature=1.0, chunk_size=None) -> [...]
    vocab_parallel_logprobs_kl(logits_p, ids, logits_q, group=None, temperature=1.0, chunk_size=None,
                               with_entropy=False, overwrite_q=False) -> (logprobs [...], kl [...], entropy [...] or
                               None)
        fused: one pass and one backward for the student's sampled-token log-probs, KL(p||q) to a
        frozen reference q (no gradient for q) and optionally the entropy metric (fused.py); overwrite_q:
        the backward writes the gradient into q's memory (a caller that drops q after backward)
    vocab_parallel_jsd(logits_student, logits_teacher, beta, group=None, temperature=1.0,
                       chunk_size=None) -> [...]
    vocab_parallel_topk(logits, k, group=None, temperature=1.0, chunk_size=None)
        -> (logprobs [..., k], global_ids [..., k])            (no gradient)
    vocab_parallel_gather(logits, ids, group=None) -> raw logits at global ids [..., K]
    vocab_parallel_support_kl(logits_student, support_ids, support_logprobs_ref, group=None,
                              temperature=1.0, support_mask=None) -> [...]
    vocab_range(vocab_shard_size, rank) -> (start, end)

impl="auto" | "triton" | "torch" on every op (last keyword): auto runs the Triton kernels on CUDA tensors when
triton is installed and the torch path otherwise (so CPU runs never change); the torch path is the reference.
Triton path: _kernels.py (layer 1: per-row kernels, a forward that writes per-split partials in one read, a
backward that writes the gradient in the logits' dtype), _triton.py (layer 2: autograd Functions, one
all-gather of the partials), the public functions here (layer 3). The gather / support-KL ops have one path
(they read K logits per token); top-k takes its normalizer from the stats kernel.

Formulas and gradients: the docstrings of logprobs.py, divergence.py, fused.py, support.py; shared machinery and
the tensor-name legend: _common.py. Tests: pytest tests/ops -x (TP=2/4 spawned tests are marked slow;
tests/ops/test_triton.py runs the Triton path through Triton's interpreter on CPU).
"""

from megaopd.ops._common import vocab_range
from megaopd.ops.divergence import vocab_parallel_jsd, vocab_parallel_kl
from megaopd.ops.fused import vocab_parallel_logprobs_kl
from megaopd.ops.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs, vocab_parallel_logsumexp
from megaopd.ops.support import vocab_parallel_gather, vocab_parallel_support_kl, vocab_parallel_topk

__all__ = [
    "vocab_range",
    "vocab_parallel_logprobs",
    "vocab_parallel_logsumexp",
    "vocab_parallel_entropy",
    "vocab_parallel_kl",
    "vocab_parallel_logprobs_kl",
    "vocab_parallel_jsd",
    "vocab_parallel_topk",
    "vocab_parallel_gather",
    "vocab_parallel_support_kl",
]
