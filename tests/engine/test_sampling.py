"""Sampling math on fixed logits: filtering sets, frequencies (chi-square), log-probs, determinism."""

import pytest
import torch

from megaopd.engine.sampling import (
    RowSampling,
    filtered_probs,
    keep_mask,
    needs_filter,
    row_uniforms,
    sample_tokens,
    scaled_logprobs,
)

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
    # Row b draws its token index b of seed `seed`: n independent draws.
    rows = RowSampling(
        temperature_B=torch.full((B,), temperature),
        top_p_B=torch.full((B,), top_p),
        top_k_B=torch.full((B,), top_k, dtype=torch.long),
        seed_B=torch.full((B,), seed),
        index_B=torch.arange(B),
        min_p_B=torch.full((B,), min_p),
    )
    ids, lps = sample_tokens(logits_BV, rows, filters=needs_filter(top_p, top_k, min_p, 8))
    return ids, lps


def expected_probs(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0):
    return filtered_probs(
        LOGITS[None], torch.tensor([temperature]), torch.tensor([top_p]), torch.tensor([top_k]), torch.tensor([min_p])
    )[0]


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


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(top_k=3),
        dict(top_p=0.7),
        dict(temperature=0.5, top_p=0.9),
        dict(temperature=2.0, top_k=5),
        dict(min_p=0.2),
    ],
)
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


def test_mixed_rows_are_independent():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    temp = torch.tensor([0.0, 1.0, 0.8])
    top_p = torch.tensor([1.0, 0.9, 1.0])
    top_k = torch.tensor([-1, -1, 10])
    idx = torch.tensor([0, 5, 7])

    def rows(seed, sl=slice(None)):
        return RowSampling(temperature_B=temp[sl], top_p_B=top_p[sl], top_k_B=top_k[sl], seed_B=seed, index_B=idx[sl])

    a, _ = sample_tokens(logits, rows(torch.tensor([1, 2, 3])))
    b, _ = sample_tokens(logits, rows(torch.tensor([9, 2, 3])))
    assert a[1:].tolist() == b[1:].tolist()  # a row's draw depends only on its own seed and index
    assert a[0] == logits[0].argmax()
    c, _ = sample_tokens(logits[1:2], rows(torch.tensor([2]), slice(1, 2)))
    assert c.tolist() == a[1:2].tolist()  # ...and not on the other rows of the batch


def test_unfiltered_rows_skip_the_sort_and_draw_the_same():
    """filters=False (no sort) draws what the filtering path draws when nothing is filtered."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    rows = RowSampling(
        temperature_B=torch.ones(6),
        top_p_B=torch.ones(6),
        top_k_B=torch.full((6,), -1),
        seed_B=torch.arange(6) * 11,
        index_B=torch.arange(6),
    )
    assert (
        sample_tokens(logits, rows, filters=False)[0].tolist() == sample_tokens(logits, rows, filters=True)[0].tolist()
    )
    assert not needs_filter(1.0, -1, 0.0, 300) and not needs_filter(1.0, 300, 0.0, 300)
    assert needs_filter(0.9, -1, 0.0, 300) and needs_filter(1.0, 5, 0.0, 300) and needs_filter(1.0, -1, 0.1, 300)


def test_row_uniforms_are_uniform_and_keyed():
    seeds, index = torch.arange(20000) % 97, torch.arange(20000) // 97
    u = row_uniforms(seeds, index)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    counts = torch.histc(u.float(), bins=20, min=0.0, max=1.0)
    assert chi2_pvalue(counts.long(), torch.full((20,), 0.05)) > 1e-3
    assert (
        row_uniforms(torch.tensor([5]), torch.tensor([3])).item()
        == row_uniforms(torch.tensor([5, 6]), torch.tensor([3, 3]))[0].item()
    )
    assert len(set(row_uniforms(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 1])).tolist())) == 3


def test_inverse_cdf_equals_one_level_search():
    """The two-level search picks what a float64 cumsum over the whole vocabulary picks, never a zero-mass
    token (masked tokens, padding of a vocabulary that is not a multiple of the block, u near 1)."""
    from megaopd.engine.sampling import inverse_cdf

    g = torch.Generator().manual_seed(0)
    mass = torch.rand(64, 1000, generator=g) ** 4
    mass[:, 700:] = 0  # a filtered tail, and a row with a single token
    mass[3] = 0
    mass[3, 5] = 0.2
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 0.999999])
    picked = inverse_cdf(mass, u)
    cdf = mass.double().cumsum(-1)
    ref = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    ok = (picked == ref) | (ref >= 700)  # ref can fall past the last kept token at u near 1
    assert bool(ok.all()), (picked[~ok], ref[~ok])
    assert bool((mass.gather(1, picked[:, None]) > 0).all())
    assert picked[3] == 5
