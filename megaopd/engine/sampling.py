"""Sampling math as pure functions of logits: temperature, top-k / top-p / min-p filtering, draws.

Used by the embedded engine at every decode step and tested on fixed logits
(tests/engine/test_sampling.py). The semantics follow SGLang's sampler so that a run on the embedded
engine and one on SGLang mean the same thing:

    logprob(y)  = log softmax(logits / T)[y]           T = temperature; greedy (T < 1e-6) uses T = 1
    probs       = softmax(logits / T)
    keep(y)     = rank(y) < top_k                        (top_k = -1: every token)
                  and sum of probs ranked before y <= top_p   (the nucleus; ties broken by sort order)
                  and probs[y] >= min_p * max(probs)
    y ~ probs * keep / sum(probs * keep)                 inverse CDF, one uniform per row from its
                                                         own torch.Generator

The reported log-prob is of the unfiltered, temperature-scaled distribution (no renormalization after
top-k / top-p), as SGLang reports it; the trainer's recomputed log-probs use the same temperature.

Legend: B = rows (sequences), V = vocabulary.
"""
from __future__ import annotations

from typing import Sequence

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


def keep_mask(probs_BV: torch.Tensor, top_p_B: torch.Tensor, top_k_B: torch.Tensor,
              min_p_B: torch.Tensor | None = None) -> torch.Tensor:
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


def filtered_probs(logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_p_B: torch.Tensor,
                   top_k_B: torch.Tensor, min_p_B: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution a row samples from: softmax(logits / T) restricted to keep_mask, renormalized."""
    probs_BV = scaled_logprobs(logits_BV, temperature_B).exp()
    probs_BV = probs_BV * keep_mask(probs_BV, top_p_B, top_k_B, min_p_B)
    return probs_BV / probs_BV.sum(dim=-1, keepdim=True)


def sample_tokens(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor,
    top_k_B: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    min_p_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws one token per row; returns (ids_B int64, logprobs_B float32).

    Greedy rows (temperature < 1e-6) take the argmax. Every sampled row draws from its own generator
    (None: torch's global one), so a row's draws do not depend on which other rows share the batch.
    logprobs_B are log softmax(logits / T) at the chosen ids, before any filtering.
    """
    B = logits_BV.shape[0]
    if len(generators) != B:
        raise ValueError(f"got {len(generators)} generators for {B} rows")
    logprobs_BV = scaled_logprobs(logits_BV, temperature_B)
    ids_B = logprobs_BV.argmax(dim=-1)
    sampled_B = temperature_B >= GREEDY_EPS
    if bool(sampled_B.any()):
        rows = sampled_B.nonzero().flatten()
        probs_RV = logprobs_BV[rows].exp()
        probs_RV = probs_RV * keep_mask(probs_RV, top_p_B[rows], top_k_B[rows],
                                        None if min_p_B is None else min_p_B[rows])
        # Inverse-CDF draw: one uniform per row from that row's own generator (torch.multinomial takes a
        # single generator, so a per-row multinomial loop would cost ~10x more per step), then one
        # vectorized search of the cumulative mass. Generators live on the CPU (cheap to seed, portable).
        u_R = torch.cat([torch.rand(1, generator=generators[r], dtype=torch.float64) for r in rows.tolist()])
        cdf_RV = probs_RV.double().cumsum(dim=-1)
        target_R1 = (u_R.to(cdf_RV.device) * cdf_RV[:, -1]).unsqueeze(-1)
        # The first token whose cumulative mass exceeds u * total; zero-mass tokens never qualify.
        picked_R = torch.searchsorted(cdf_RV, target_R1, right=True).squeeze(-1).clamp(max=probs_RV.shape[-1] - 1)
        # Rounding can land past the last kept token (u * total == total): take the last kept one then.
        bad_R = probs_RV.gather(-1, picked_R.unsqueeze(-1)).squeeze(-1) <= 0
        if bool(bad_R.any()):
            last_kept_R = (probs_RV > 0).cumsum(-1).argmax(-1)
            picked_R = torch.where(bad_R, last_kept_R, picked_R)
        ids_B[rows] = picked_R
    return ids_B, logprobs_BV.gather(-1, ids_B.unsqueeze(-1)).squeeze(-1).float()


def row_generator(seed: int) -> torch.Generator:
    """A CPU generator for one row; seeds are reduced to 63 bits (torch's accepted range)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    return g
