"""Sampling math as pure functions of logits: temperature, top-k / top-p / min-p filtering, draws.

Used by the embedded engine at every decode step and tested on fixed logits
(tests/engine/test_sampling.py). The semantics follow SGLang's sampler so that a run on the embedded
engine and one on SGLang mean the same thing:

    logprob(y)  = log softmax(logits / T)[y]           T = temperature; greedy (T < 1e-6) uses T = 1
    probs       = softmax(logits / T)
    keep(y)     = rank(y) < top_k                        (top_k = -1: every token)
                  and sum of probs ranked before y <= top_p   (the nucleus; ties broken by sort order)
                  and probs[y] >= min_p * max(probs)
    y ~ probs * keep / sum(probs * keep)                 inverse CDF, one uniform per row:
                                                         u = hash(row seed, token index), on the device

The reported log-prob is of the unfiltered, temperature-scaled distribution (no renormalization after
top-k / top-p), as SGLang reports it; the trainer's recomputed log-probs use the same temperature.

A row's uniform is a pure function of (its seed, the index of the token in its response) computed with
tensor ops on the logits' device (row_uniforms): no generator state, no host round trip, the same value
whichever rows share the batch or the step, and capturable in a CUDA graph. Filtering sorts the
vocabulary, so it runs only when some row asks for top-k, top-p or min-p (`filters`).

Legend: B = rows (sequences), V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-6
"""A temperature below this is greedy decoding (SGLang's convention)."""


def effective_temperature(temperature_B: torch.Tensor) -> torch.Tensor:
    """Temperatures to divide logits by: greedy rows use 1 so their log-probs are the raw log-softmax."""
    return torch.where(temperature_B < GREEDY_EPS, torch.ones_like(temperature_B), temperature_B)


def scaled_logprobs(logits_BV: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / T) per row, in float32 (float64 input stays float64)."""
    logits_BV = logits_BV.float() if logits_BV.dtype != torch.float64 else logits_BV
    temp_B1 = effective_temperature(temperature_B.to(logits_BV)).unsqueeze(-1)
    return torch.log_softmax(logits_BV / temp_B1, dim=-1)


def keep_mask(
    probs_BV: torch.Tensor, top_p_B: torch.Tensor, top_k_B: torch.Tensor, min_p_B: torch.Tensor | None = None
) -> torch.Tensor:
    """Which tokens survive top-k, top-p and min-p filtering of `probs_BV` (rows sum to 1).

    All three filters look at the same unfiltered probabilities (top-p's cumulative mass is not
    recomputed after top-k), as in SGLang. The most likely token always survives.
    Returns a bool [B, V] mask.
    """
    B, V = probs_BV.shape
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    rank_V = torch.arange(V, device=probs_BV.device)
    k_B = torch.where(top_k_B < 0, torch.full_like(top_k_B, V), top_k_B.clamp(max=V))
    keep_sorted_BV = rank_V.unsqueeze(0) < k_B.unsqueeze(-1)
    # Exclusive prefix mass: a token is in the nucleus when the tokens ranked before it hold <= top_p.
    # top_p == 1 skips the test so float rounding in the cumsum cannot drop tail tokens.
    before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
    nucleus_BV = (before_BV <= top_p_B.to(before_BV).unsqueeze(-1)) | (top_p_B >= 1.0).unsqueeze(-1)
    keep_sorted_BV &= nucleus_BV
    if min_p_B is not None:
        threshold_B1 = (min_p_B.to(sorted_BV) * sorted_BV[:, 0]).unsqueeze(-1)
        keep_sorted_BV &= sorted_BV >= threshold_B1
    keep_sorted_BV[:, 0] = True
    keep_BV = torch.zeros_like(keep_sorted_BV)
    keep_BV.scatter_(1, order_BV, keep_sorted_BV)
    return keep_BV


def filtered_probs(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor,
    top_k_B: torch.Tensor,
    min_p_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """The distribution a row samples from: softmax(logits / T) restricted to keep_mask, renormalized."""
    probs_BV = scaled_logprobs(logits_BV, temperature_B).exp()
    probs_BV = probs_BV * keep_mask(probs_BV, top_p_B, top_k_B, min_p_B)
    return probs_BV / probs_BV.sum(dim=-1, keepdim=True)


def needs_filter(top_p: float, top_k: int, min_p: float, vocab: int) -> bool:
    """Whether a row's settings filter the distribution (else sampling needs no sort)."""
    return top_p < 1.0 or 0 <= top_k < vocab or min_p > 0.0


_MASK63 = (1 << 63) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> sign-extends)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function (a bijection of 64-bit words)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def row_uniforms(seed_B: torch.Tensor, index_B: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row, float64 with 53 random bits: output `index` of a SplitMix64 generator
    whose state starts at mix(seed), i.e. mix(mix(seed) + (index + 1) * golden), in int64 tensor arithmetic
    (multiplication wraps modulo 2^64 on every torch backend). Mixing the seed first keeps nearby seeds
    (a prompt's n samples get seed, seed + 1, ...) from sharing shifted streams."""
    x = _mix64(seed_B.long()) + (index_B.long() + 1) * _GOLDEN
    return _shr(_mix64(x), 11).double() * (1.0 / (1 << 53))


@dataclass(frozen=True, kw_only=True)
class RowSampling:
    """Each row's sampling settings and the draw it is at: [B] tensors, one value per row."""

    temperature_B: torch.Tensor
    top_p_B: torch.Tensor
    top_k_B: torch.Tensor
    seed_B: torch.Tensor
    index_B: torch.Tensor
    """The row's token index (its tokens so far): with seed_B, which uniform the draw uses."""
    min_p_B: torch.Tensor | None = None


def sample_tokens(
    logits_BV: torch.Tensor, rows: RowSampling, filters: bool = True, greedy: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws one token per row; returns (ids_B int64, logprobs_B float32). No host sync.

    Greedy rows (temperature < 1e-6) take the argmax. A sampled row's draw is the inverse CDF at
    row_uniforms(seed, index): it depends on its own logits, seed and token index only.
    filters=False (no row filters: see needs_filter) skips the sort of keep_mask; greedy=False (no
    greedy row) skips the argmax. logprobs_B are log softmax(logits / T) at the chosen ids, before any
    filtering (the log of the float32 softmax: within 1e-6 of log_softmax for any sampled token).
    """
    temperature_B = rows.temperature_B
    logits_BV = logits_BV.float() if logits_BV.dtype != torch.float64 else logits_BV
    probs_BV = torch.softmax(logits_BV / effective_temperature(temperature_B.to(logits_BV)).unsqueeze(-1), dim=-1)
    mass_BV = probs_BV * keep_mask(probs_BV, rows.top_p_B, rows.top_k_B, rows.min_p_B) if filters else probs_BV
    ids_B = inverse_cdf(mass_BV, row_uniforms(rows.seed_B, rows.index_B).to(logits_BV.device))
    if greedy:
        ids_B = torch.where(temperature_B.to(ids_B.device) < GREEDY_EPS, probs_BV.argmax(dim=-1), ids_B)
    return ids_B, probs_BV.gather(-1, ids_B.unsqueeze(-1)).squeeze(-1).log().float()


INVERSE_CDF_BLOCK = 256
"""Tokens per block of inverse_cdf's first level (152064 and 32000 are multiples of it)."""


def inverse_cdf(mass_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative mass exceeds u * total mass (mass >= 0, not normalized):
    the token a uniform u draws. Two levels so that no float64 cumsum runs over the whole vocabulary
    (3.7 ms a step at 16 x 32000 on one CPU thread): float64 sums of blocks of INVERSE_CDF_BLOCK tokens,
    their cumsum, the block the target falls in, then the cumsum of that block only. The target is kept
    below the total and measured from the exact cumulative mass before its block, so the token picked
    always has positive mass."""
    B, V = mass_BV.shape
    W = INVERSE_CDF_BLOCK
    nb = -(-V // W)
    padded = torch.nn.functional.pad(mass_BV, (0, nb * W - V)) if nb * W != V else mass_BV
    blocks_BnW = padded.view(B, nb, W)
    cum_Bn = blocks_BnW.sum(-1, dtype=torch.float64).cumsum(-1)
    total_B1 = cum_Bn[:, -1:]
    target_B1 = torch.minimum(
        u_B.to(cum_Bn).unsqueeze(-1) * total_B1, torch.nextafter(total_B1, torch.zeros_like(total_B1))
    )
    blk_B1 = torch.searchsorted(cum_Bn, target_B1, right=True).clamp(max=nb - 1)
    before_B1 = torch.where(blk_B1 > 0, cum_Bn.gather(-1, (blk_B1 - 1).clamp(min=0)), torch.zeros_like(target_B1))
    inblock_BW = blocks_BnW.gather(1, blk_B1.unsqueeze(-1).expand(B, 1, W)).squeeze(1).double().cumsum(-1)
    rest_B1 = torch.minimum(target_B1 - before_B1, torch.nextafter(inblock_BW[:, -1:], torch.zeros_like(total_B1)))
    j_B1 = torch.searchsorted(inblock_BW, rest_B1, right=True).clamp(max=W - 1)
    return (blk_B1 * W + j_B1).squeeze(-1)
