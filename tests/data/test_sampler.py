"""The prompt order: deterministic per step, identical after a state_dict round trip, sharded over DP."""

from collections import Counter

import pytest

from megaopd.data.sampler import MixtureSampler, quotas


def take(sampler, steps, bs, rank=0, dp=1):
    return [sampler.next_batch(bs, rank, dp) for _ in range(steps)]


def test_same_seed_same_batches_other_seed_other_batches():
    a = take(MixtureSampler([37, 11], [0.7, 0.3], seed=3), 10, 8)
    b = take(MixtureSampler([37, 11], [0.7, 0.3], seed=3), 10, 8)
    c = take(MixtureSampler([37, 11], [0.7, 0.3], seed=4), 10, 8)
    assert a == b and a != c


def test_resume_replays_the_same_next_batches():
    run = MixtureSampler([37, 11], [0.7, 0.3], seed=3)
    take(run, 5, 8)  # crosses into epoch 1 (epoch size 48) partway through step 6
    state = run.state_dict()
    rest = take(run, 12, 8)
    resumed = MixtureSampler([37, 11], [0.7, 0.3], seed=3)
    resumed.load_state_dict(state)
    assert take(resumed, 12, 8) == rest
    # The step-indexed view gives the same batches without any state.
    fresh = MixtureSampler([37, 11], [0.7, 0.3], seed=3)
    assert [fresh.batch_at_step(s, 8) for s in range(5, 17)] == rest


def test_dp_ranks_get_disjoint_slices_covering_the_global_batch():
    dp, bs = 4, 16
    whole = take(MixtureSampler([50, 30], [5, 3], seed=0), 6, bs)
    shards = [take(MixtureSampler([50, 30], [5, 3], seed=0), 6, bs, r, dp) for r in range(dp)]
    for step in range(6):
        parts = [shards[r][step] for r in range(dp)]
        assert all(len(p) == bs // dp for p in parts)
        assert sum(parts, []) == whole[step]
        assert len(set(sum(parts, []))) == bs  # no prompt twice within an epoch's batch
    with pytest.raises(ValueError, match="multiple of the data-parallel size"):
        MixtureSampler([50], seed=0).next_batch(10, 0, 4)


def test_one_epoch_visits_every_prompt_once_and_mixture_follows_weights():
    s = MixtureSampler([20], seed=1)
    assert sorted(sum(take(s, 5, 4), [])) == [(0, i) for i in range(20)]
    assert quotas(100, [3, 1]) == [75, 25] and quotas(10, [1, 1, 1]) == [4, 3, 3]
    # A small source with a large weight repeats; a big one with a small weight spreads over epochs.
    m = MixtureSampler([10, 1000], [0.5, 0.5], seed=2, epoch_size=200)
    refs = sum(take(m, 10, 20), [])
    counts = Counter(src for src, _ in refs)
    assert counts == {0: 100, 1: 100}
    assert Counter(i for src, i in refs if src == 0) == {i: 10 for i in range(10)}
    assert len({i for src, i in refs if src == 1}) == 100


def test_unshuffled_order_interleaves_sources_in_file_order():
    s = MixtureSampler([4, 2], [2, 1], seed=0, shuffle=False)
    assert s.next_batch(6) == [(0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (0, 3)]


def test_state_from_other_data_is_refused():
    state = MixtureSampler([37, 11], seed=3).state_dict()
    with pytest.raises(ValueError, match="sizes"):
        MixtureSampler([37, 12], seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        MixtureSampler([37, 11], seed=5).load_state_dict(state)
