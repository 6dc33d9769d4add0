"""Sampling math on fixed logits: filtering sets, frequencies (chi-square), log-probs, determinism."""

import pytest
import torch

from megaopd.engine.sampling import (filtered_probs, keep_mask, row_generator, sample_tokens, scaled_logprobs)

# Fixed logits over 8 tokens; softmax at T=1 is about [.43 .21 .16 .08 .06 .03 .02 .01].
LOGITS = torch.tensor([2.0, 1.3, 1.0, 0.3, 0.0, -0.7, -1.0, -1.7])


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit over the tokens with probs > 0; survival via gammaincc."""
    support = probs > 0
    n = counts.sum().double()
    expected = probs[support].double() * n
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def draw(logits, n, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0):
    B = n
    logits_BV = logits.expand(B, -1).clone()
    g = row_generator(seed)
    ids, lps = sample_tokens(logits_BV, torch.full((B,), temperature), torch.full((B,), top_p),
                             torch.full((B,), top_k, dtype=torch.long), [g] * B, torch.full((B,), min_p))
    return ids, lps


def expected_probs(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0):
    return filtered_probs(LOGITS[None], torch.tensor([temperature]), torch.tensor([top_p]),
                          torch.tensor([top_k]), torch.tensor([min_p]))[0]


def test_keep_mask_sets():
    probs = torch.softmax(LOGITS, -1)[None]
    one = torch.ones(1)
    k3 = keep_mask(probs, one, torch.tensor([3]))
    assert k3[0].tolist() == [True] * 3 + [False] * 5
    # Nucleus 0.6: tokens 0 (0.43) and 1 (0.21) hold 0.64 >= 0.6, so token 2 (prefix 0.64) is out.
    p = keep_mask(probs, torch.tensor([0.6]), torch.tensor([-1]))
    assert p[0].tolist() == [True, True] + [False] * 6
    # Exactly at the boundary the next token is kept (prefix mass <= top_p, SGLang's rule).
    boundary = float(probs[0, :2].sum())
    assert keep_mask(probs, torch.tensor([boundary + 1e-6]), torch.tensor([-1]))[0, 2]
    # Tiny top_p keeps only the argmax.
    assert keep_mask(probs, torch.tensor([1e-6]), torch.tensor([-1]))[0].tolist() == [True] + [False] * 7
    # top-k and top-p both apply to the unfiltered probabilities.
    both = keep_mask(probs, torch.tensor([0.9]), torch.tensor([2]))
    assert both[0].tolist() == [True, True] + [False] * 6
    mp = keep_mask(probs, one, torch.tensor([-1]), torch.tensor([0.3]))  # >= 0.3 * 0.43
    assert mp[0].tolist() == [True, True, True, False, False, False, False, False]


def test_keep_mask_unsorted_logits():
    perm = torch.tensor([5, 2, 7, 0, 3, 1, 6, 4])
    probs = torch.softmax(LOGITS[perm], -1)[None]
    keep = keep_mask(probs, torch.tensor([1.0]), torch.tensor([2]))[0]
    assert sorted(perm[keep].tolist()) == [0, 1]


@pytest.mark.parametrize("kw", [dict(), dict(top_k=3), dict(top_p=0.7), dict(temperature=0.5, top_p=0.9),
                                dict(temperature=2.0, top_k=5), dict(min_p=0.2)])
def test_sample_frequencies_match_filtered_distribution(kw):
    probs = expected_probs(**kw)
    ids, _ = draw(LOGITS, 6000, seed=1234, **kw)
    counts = torch.bincount(ids, minlength=8)
    # Never a token outside the kept set...
    assert int(counts[probs == 0].sum()) == 0, (counts, probs)
    # ...and the frequencies fit the renormalized distribution (fixed seed, so this is not flaky).
    assert chi2_pvalue(counts, probs) > 1e-3, (counts, probs)


def test_logprobs_are_before_filtering():
    T = 0.7
    ids, lps = draw(LOGITS, 64, temperature=T, top_k=2, seed=3)
    ref = torch.log_softmax(LOGITS.double() / T, -1)
    assert torch.allclose(lps.double(), ref[ids], atol=1e-6)
    assert set(ids.tolist()) <= {0, 1}


def test_greedy_takes_argmax_with_raw_logprob():
    ids, lps = draw(LOGITS, 4, temperature=0.0)
    assert ids.tolist() == [0] * 4
    assert torch.allclose(lps, torch.log_softmax(LOGITS, -1)[0].expand(4), atol=1e-6)
    assert torch.allclose(scaled_logprobs(LOGITS[None], torch.tensor([1e-9])), torch.log_softmax(LOGITS, -1)[None])


def test_mixed_rows_and_generators_are_independent():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    temp = torch.tensor([0.0, 1.0, 0.8])
    top_p = torch.tensor([1.0, 0.9, 1.0])
    top_k = torch.tensor([-1, -1, 10])
    a, _ = sample_tokens(logits, temp, top_p, top_k, [row_generator(s) for s in (1, 2, 3)])
    b, _ = sample_tokens(logits, temp, top_p, top_k, [row_generator(s) for s in (9, 2, 3)])
    assert a[1:].tolist() == b[1:].tolist()  # a row's draw depends only on its own generator
    assert a[0] == logits[0].argmax()
    c, _ = sample_tokens(logits[1:2], temp[1:2], top_p[1:2], top_k[1:2], [row_generator(2)])
    assert c.tolist() == a[1:2].tolist()  # ...and not on the other rows of the batch

