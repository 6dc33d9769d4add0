"""Deterministic, resumable prompt order over weighted sources, sharded over data-parallel ranks.

    sampler = MixtureSampler(source_sizes=[13000, 500], weights=[0.9, 0.1], seed=1234)
    refs = sampler.next_batch(64, dp_rank=r, dp_size=4)   # this rank's 16 (source, index) pairs
    state = sampler.state_dict()                          # {"epoch", "position", ...} into the checkpoint
    sampler.load_state_dict(state)                        # the next batches are the ones that would have come

The stream is a sequence of mixed epochs. Epoch e holds E items (E = sum of source sizes by default);
source k contributes a quota q_k of them, E * w_k / sum(w) rounded by largest remainder. Source k's items
come from its own endless stream of seeded permutations (permutation c covers its rows once), so a source
smaller than its quota repeats and a larger one is visited over several epochs without bias. The epoch's
items are then shuffled with seed (seed, e). Everything is a pure function of (seed, sizes, weights, epoch),
so the batch at (epoch, position) is the same in every run and on every rank: a global batch is the next B
items (continuing into the next epoch when one runs out), and DP rank r takes the r-th of dp_size equal
contiguous slices. With a constant batch size B, step s starts at global item s * B
(`batch_at_step`): resume replays the same batches whether or not the state was saved.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Optional, Sequence

Ref = tuple[int, int]
"""(source index, row index within the source)."""


def quotas(epoch_size: int, weights: Sequence[float]) -> list[int]:
    """Items per source in one epoch: epoch_size split by weight, largest remainder (ties: earlier source)."""
    total = float(sum(weights))
    exact = [epoch_size * w / total for w in weights]
    got = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - got[i]), i))
    for i in order[: epoch_size - sum(got)]:
        got[i] += 1
    return got


def _interleave(counts: Sequence[int]) -> list[int]:
    """Source ids spread evenly by count (unshuffled epochs): the k-th item of source s sits at (k+0.5)/n_s."""
    keyed = [((k + 0.5) / n, s) for s, n in enumerate(counts) for k in range(n)]
    return [s for _, s in sorted(keyed)]


class MixtureSampler:
    """The deterministic prompt stream; its only state is (epoch, position) within the epoch."""

    def __init__(
        self,
        source_sizes: Sequence[int],
        weights: Optional[Sequence[float]] = None,
        seed: int = 0,
        shuffle: bool = True,
        epoch_size: Optional[int] = None,
    ):
        sizes = [int(n) for n in source_sizes]
        if not sizes or any(n < 1 for n in sizes):
            raise ValueError(f"source sizes {sizes}: every source needs at least one prompt")
        weights = list(weights) if weights is not None else [1.0] * len(sizes)
        if len(weights) != len(sizes) or any(not w > 0 for w in weights):
            raise ValueError(f"weights {weights} must be one positive number per source ({len(sizes)})")
        # With one source, or weights equal to the sizes' shares, an epoch is one pass over every row.
        self.epoch_size = int(epoch_size or sum(sizes))
        if self.epoch_size < 1:
            raise ValueError(f"epoch_size={epoch_size} must be positive")
        self.sizes, self.weights, self.seed, self.shuffle = sizes, weights, int(seed), bool(shuffle)
        self.quotas = quotas(self.epoch_size, weights)
        self.epoch = 0
        self.position = 0
        self._epoch_cache = lru_cache(maxsize=2)(self._build_epoch)

    # ---- pure functions of (seed, sizes, weights, epoch) ----
    def _permutation(self, source: int, cycle: int) -> list[int]:
        order = list(range(self.sizes[source]))
        if self.shuffle:
            random.Random(f"megaopd-source/{self.seed}/{source}/{cycle}").shuffle(order)
        return order

    def _source_items(self, source: int, start: int, count: int) -> list[int]:
        """Items start .. start+count-1 of source's endless stream of permutations."""
        n, out = self.sizes[source], []
        j = start
        while len(out) < count:
            cycle, offset = divmod(j, n)
            perm = self._permutation(source, cycle)
            take = min(n - offset, count - len(out))
            out.extend(perm[offset : offset + take])
            j += take
        return out

    def _build_epoch(self, epoch: int) -> tuple[Ref, ...]:
        per_source = [self._source_items(k, epoch * q, q) for k, q in enumerate(self.quotas)]
        if self.shuffle:
            refs = [(k, i) for k, items in enumerate(per_source) for i in items]
            random.Random(f"megaopd-epoch/{self.seed}/{epoch}").shuffle(refs)
        else:
            cursors = [0] * len(per_source)
            refs = []
            for k in _interleave(self.quotas):
                refs.append((k, per_source[k][cursors[k]]))
                cursors[k] += 1
        return tuple(refs)

    def epoch_refs(self, epoch: int) -> tuple[Ref, ...]:
        return self._epoch_cache(epoch)

    def global_batch_at(self, epoch: int, position: int, batch_size: int) -> tuple[list[Ref], int, int]:
        """(the batch_size items from (epoch, position), the epoch and position after them)."""
        out: list[Ref] = []
        while len(out) < batch_size:
            refs = self.epoch_refs(epoch)
            take = min(len(refs) - position, batch_size - len(out))
            out.extend(refs[position : position + take])
            position += take
            if position == len(refs):
                epoch, position = epoch + 1, 0
        return out, epoch, position

    @staticmethod
    def rank_slice(global_refs: Sequence[Ref], dp_rank: int, dp_size: int) -> list[Ref]:
        """DP rank r's contiguous share: disjoint across ranks, together exactly the global batch."""
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if len(global_refs) % dp_size:
            raise ValueError(
                f"batch size {len(global_refs)} is not a multiple of dp_size={dp_size}: make "
                f"trainer.prompts_per_step a multiple of the data-parallel size"
            )
        per = len(global_refs) // dp_size
        return list(global_refs[dp_rank * per : (dp_rank + 1) * per])

    def batch_at_step(self, step: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> list[Ref]:
        """The rank's share of step `step`'s batch, for a run that always drew batch_size items per step."""
        epoch, position = divmod(step * batch_size, self.epoch_size)
        refs, _, _ = self.global_batch_at(epoch, position, batch_size)
        return self.rank_slice(refs, dp_rank, dp_size)

    # ---- the stateful cursor ----
    def next_batch(self, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> list[Ref]:
        """This rank's share of the next global batch; every rank advances by the whole batch."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be positive")
        refs, self.epoch, self.position = self.global_batch_at(self.epoch, self.position, batch_size)
        return self.rank_slice(refs, dp_rank, dp_size)

    def state_dict(self) -> dict:
        # sizes/weights/seed travel with the cursor so that a resume on changed data fails loudly instead
        # of silently replaying another order.
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "sizes": list(self.sizes),
            "weights": list(self.weights),
            "shuffle": self.shuffle,
            "epoch_size": self.epoch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "sizes", "weights", "shuffle", "epoch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"data sampler state was saved with {key}={state[key]} but this run has "
                    f"{key}={getattr(self, key)}: the checkpoint's data order cannot be replayed; resume "
                    f"with the same data and data.seed, or start a new run directory"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.epoch_size:
            raise ValueError(
                f"data sampler state epoch={epoch}, position={position} is out of range (epoch size {self.epoch_size})"
            )
        self.epoch, self.position = epoch, position
