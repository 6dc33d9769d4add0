"""How the embedded engine generates a run of rows: continuous batching over the slots of a static KV cache.

    waiting rows --(a slot is free)--> prefill into the slot --> decode steps --(stop / length)--> result

The cache has S slots (EmbeddedEngineConfig.max_batch_size). While rows wait and slots are free, the
waiting rows (longest budget first: the long tail starts early) are prefilled into them: each distinct
prompt once, its keys copied into the slots of its samples. While rows run, admission waits until
`admit_min` slots are free (or every waiting row fits): a prefill is an eager forward, which on a GPU costs
several decode steps whatever its rows, so admitting rows one by one as they finish costs more than a few
idle slots (EmbeddedEngineConfig.admit_min). Every step then samples a token for each
running row and feeds it back (megaopd.engine.forward). A row that finishes frees its slot, and the last
running row moves into it, so the running rows stay packed in slots 0 .. A-1.

Everything per row lives on the device: last token, position, token count, budget, stop ids, sampling
settings, the generated ids and log-probs. Sampling draws from (row seed, token index)
(megaopd.engine.sampling.row_uniforms), so a seeded row's tokens do not depend on which rows share its
steps; stop and length checks are tensor ops. The host reads the finished flags every `sync_every` steps
(1 on CPU, where reading is free; more on CUDA, where every read stalls the launch queue); a row that
finished in between runs on until then, and what it makes after its end is dropped.

Between two steps decode_rows asks its `boundary` what to do next: "go" on, "retract" (re-prefill every
running row, prompt + tokens so far, under what may be new weights), or "abort" (running and waiting rows
end with finish reason "abort", running ones keep the tokens they have). The runner's boundary is where a
pause, an abort or a weight load intervenes.

Legend: S slots, A running rows, N longest budget, K most stop ids of a row, V vocabulary.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, fields
from typing import Callable, Literal

import torch
from torch.profiler import record_function  # named phases of a decode for the profiler (gpucheck --profile)

from megaopd.engine.cache import PrefillCopy, SlotCache
from megaopd.engine.forward import Forward
from megaopd.engine.rows import RowRequest, RowResult
from megaopd.engine.sampling import GREEDY_EPS, RowSampling, needs_filter, sample_tokens

StepAction = Literal["go", "retract", "abort"]


@dataclass
class SlotState:
    """Per-slot tensors on the device (first dim S); slot a < A holds running row row_S[a]."""

    row_S: torch.Tensor
    token_S: torch.Tensor
    """The last sampled token, fed at the next step."""
    pos_S: torch.Tensor
    """Where token_S is written in the slot (= tokens in the slot's cache)."""
    count_S: torch.Tensor
    """Tokens generated (valid entries of out_ids_SN)."""
    budget_S: torch.Tensor
    seed_S: torch.Tensor
    temp_S: torch.Tensor
    top_p_S: torch.Tensor
    top_k_S: torch.Tensor
    min_p_S: torch.Tensor
    stop_SK: torch.Tensor
    """Stop ids, padded with -1."""
    done_S: torch.Tensor
    out_ids_SN: torch.Tensor
    out_lp_SN: torch.Tensor

    @classmethod
    def empty(cls, S: int, N: int, K: int, device) -> "SlotState":
        z = lambda *shape, dt=torch.long: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
        return cls(
            row_S=z(S),
            token_S=z(S),
            pos_S=z(S),
            count_S=z(S),
            budget_S=z(S),
            seed_S=z(S),
            temp_S=z(S, dt=torch.float32),
            top_p_S=z(S, dt=torch.float32),
            top_k_S=z(S),
            min_p_S=z(S, dt=torch.float32),
            stop_SK=z(S, K) - 1,
            done_S=z(S, dt=torch.bool),
            out_ids_SN=z(S, N + 1),
            out_lp_SN=z(S, N + 1, dt=torch.float32),
        )

    def move(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        s = torch.tensor(src, device=self.row_S.device)
        d = torch.tensor(dst, device=self.row_S.device)
        for f in fields(self):
            t = getattr(self, f.name)
            t[d] = t[s]

    def admit(self, at: int, rows: list[RowRequest], idx: list[int], seeds: list[int], K: int) -> None:
        """Fills slots at .. at+len(rows)-1 with fresh rows (one host-to-device copy per field)."""
        sl = slice(at, at + len(rows))
        put = lambda t, vals, dt=torch.long: t[sl].copy_(torch.tensor(vals, dtype=dt), non_blocking=True)  # noqa: E731
        put(self.row_S, idx)
        put(self.pos_S, [len(r.prompt_ids) for r in rows])
        put(self.budget_S, [r.max_new_tokens for r in rows])
        put(self.seed_S, seeds)
        put(self.temp_S, [r.temperature for r in rows], torch.float32)
        put(self.top_p_S, [r.top_p for r in rows], torch.float32)
        put(self.top_k_S, [r.top_k for r in rows])
        put(self.min_p_S, [r.min_p for r in rows], torch.float32)
        put(self.stop_SK, [sorted(r.stop_ids) + [-1] * (K - len(r.stop_ids)) for r in rows])
        self.count_S[sl] = 0
        self.done_S[sl] = False


@dataclass
class Decoder:
    """The model call of a decode step: eager, or replayed from CUDA graphs (megaopd.engine.graphs)."""

    fwd: Forward
    cache: SlotCache
    graphs: object | None = None

    def step(self, st: SlotState, A: int, length: int) -> torch.Tensor:
        if self.graphs is not None:
            logits = self.graphs.step(st, A, length)
            if logits is not None:
                return logits
        rows_A = torch.arange(A, device=self.fwd.device)
        return self.fwd.step(self.cache, st.token_S[:A], st.pos_S[:A], rows_A, length)


@torch.inference_mode()
def decode_rows(
    dec: Decoder,
    rows: list[RowRequest],
    weight_version: str,
    boundary: Callable[[], StepAction],
    sync_every: int = 1,
    admit_min: int = 1,
) -> list[RowResult]:
    """Generates every row through the cache's slots; results in row order, each tagged with weight_version."""
    fwd, cache = dec.fwd, dec.cache
    S, device, vocab = cache.slots, fwd.device, int(fwd.model.config.get_text_config().vocab_size)
    results = [RowResult(weight_version=weight_version) for _ in rows]
    seeds = [r.seed if r.seed is not None else int(torch.randint(0, 2**62, (1,)).item()) for r in rows]
    N = max(r.max_new_tokens for r in rows)
    K = max(1, max(len(r.stop_ids) for r in rows))
    filters = any(needs_filter(r.top_p, r.top_k, r.min_p, vocab) for r in rows)
    greedy = any(r.temperature < GREEDY_EPS for r in rows)
    st = SlotState.empty(S, N, K, device)
    waiting = collections.deque(sorted(range(len(rows)), key=lambda i: -rows[i].max_new_tokens))
    running: list[int] = []  # row index of slots 0 .. A-1
    pos_h: list[int] = []  # host copy of pos_S[:A]
    logits = None  # [A, V] of the running rows, to sample from
    steps = 0
    while True:
        free = S - len(running)
        if waiting and free and (not running or free >= min(admit_min, len(waiting))):
            new = [waiting.popleft() for _ in range(min(free, len(waiting)))]
            with record_function("engine.prefill"):
                new_logits = _prefill(fwd, cache, st, rows, new, seeds, len(running))
            running += new
            pos_h += [len(rows[i].prompt_ids) for i in new]
            # float32 throughout: prefill returns float32 logits and a bf16 decode step its own dtype; a row's first
            # token must not depend on whether it was admitted beside running rows.
            logits = new_logits if logits is None else torch.cat([logits.float(), new_logits.float()])
        A = len(running)
        with record_function("engine.sample"):
            running_rows = RowSampling(
                temperature_B=st.temp_S[:A],
                top_p_B=st.top_p_S[:A],
                top_k_B=st.top_k_S[:A],
                seed_B=st.seed_S[:A],
                index_B=st.count_S[:A],
                min_p_B=st.min_p_S[:A],
            )
            tok_A, lp_A = sample_tokens(logits, running_rows, filters, greedy)
        ar_A = torch.arange(A, device=device)
        live_A = ~st.done_S[:A]
        st.out_ids_SN[ar_A, st.count_S[:A]] = tok_A
        st.out_lp_SN[ar_A, st.count_S[:A]] = lp_A
        st.token_S[:A] = tok_A
        st.count_S[:A] += live_A.long()
        ended = (tok_A[:, None] == st.stop_SK[:A]).any(-1) | (st.count_S[:A] >= st.budget_S[:A])
        st.done_S[:A] |= ended & live_A
        steps += 1
        if steps % sync_every == 0:
            with record_function("engine.harvest"):
                running, pos_h = _harvest(st, cache, rows, results, running, pos_h)
        if not running and not waiting:
            break
        action = boundary()
        if action == "abort":
            _harvest(st, cache, rows, results, running, pos_h, finish_all="abort")
            for i in waiting:
                results[i].finish_reason = "abort"
            break
        if action == "retract":
            running, pos_h = _harvest(st, cache, rows, results, running, pos_h)
            if not running and not waiting:  # every row had finished since the last harvest (sync_every > 1)
                break
            A = len(running)
            counts, ids = st.count_S[:A].tolist(), st.out_ids_SN[:A].tolist()
            seqs = [list(rows[i].prompt_ids) + ids[a][: counts[a]] for a, i in enumerate(running)]
            logits = _reprefill(fwd, cache, st, seqs)
            pos_h = [len(s) for s in seqs]
            continue
        if not running:
            logits = None
            continue
        with record_function("engine.decode_step"):
            logits = dec.step(st, len(running), max(pos_h) + 1)
        # finished rows not yet harvested (sync_every > 1) stay put: no position past the row's budget
        st.pos_S[: len(running)] += (~st.done_S[: len(running)]).long()
        pos_h = [p + 1 for p in pos_h]
    return results


def _prefill(
    fwd: Forward,
    cache: SlotCache,
    st: SlotState,
    rows: list[RowRequest],
    new: list[int],
    seeds: list[int],
    at: int,
) -> torch.Tensor:
    """Prefills rows `new` into slots at, at+1, ...: each distinct prompt once. Returns their logits [n, V]."""
    seqs = [list(rows[i].prompt_ids) for i in new]
    K = st.stop_SK.shape[1]  # stop ids per slot, as the state was made for the call's rows
    unique: dict[tuple[int, ...], int] = {}
    u_of = [unique.setdefault(tuple(s), len(unique)) for s in seqs]
    P = max(len(s) for s in unique)
    copies = [PrefillCopy(u=u, slot=at + j, pad=P - len(seqs[j]), length=len(seqs[j])) for j, u in enumerate(u_of)]
    logits_U = fwd.prefill(cache, [list(s) for s in unique], copies)
    st.admit(at, [rows[i] for i in new], new, [seeds[i] for i in new], K)
    return logits_U[torch.tensor(u_of, device=logits_U.device)]


def _reprefill(fwd: Forward, cache: SlotCache, st: SlotState, seqs: list[list[int]]) -> torch.Tensor:
    """Recomputes the running rows' caches (prompt + tokens so far) in their slots 0 .. A-1; the token
    last sampled is part of the sequence, so the logits returned are for the next one."""
    if not seqs:
        return None
    P = max(len(s) for s in seqs)
    copies = [PrefillCopy(u=j, slot=j, pad=P - len(s), length=len(s)) for j, s in enumerate(seqs)]
    logits = fwd.prefill(cache, seqs, copies)
    st.pos_S[: len(seqs)] = torch.tensor([len(s) for s in seqs], device=st.pos_S.device)
    return logits


def _harvest(
    st: SlotState,
    cache: SlotCache,
    rows: list[RowRequest],
    results: list[RowResult],
    running: list[int],
    pos_h: list[int],
    finish_all: str | None = None,
):
    """Copies finished rows' tokens to their results and packs the survivors into the first slots.
    finish_all: every running row ends (with that reason); returns (running, pos_h) after packing."""
    A = len(running)
    if A == 0:
        return running, pos_h
    finished = st.done_S[:A].tolist()
    done = finished if finish_all is None else [True] * A
    ended = [a for a in range(A) if done[a]]
    if not ended:
        return running, pos_h
    e = torch.tensor(ended, device=st.row_S.device)
    counts = st.count_S[e].tolist()
    ids, lps = st.out_ids_SN[e].tolist(), st.out_lp_SN[e].tolist()
    for j, a in enumerate(ended):
        res, req, c = results[running[a]], rows[running[a]], counts[j]
        res.output_ids, res.logprobs = ids[j][:c], lps[j][:c]
        if not finished[a]:
            res.finish_reason = finish_all
        elif c and res.output_ids[-1] in req.stop_ids:
            res.finish_reason, res.matched = "stop", res.output_ids[-1]
        else:
            res.finish_reason = "length"
    if finish_all is not None:
        return [], []
    keep = [a for a in range(A) if not done[a]]
    A2 = len(keep)
    holes = [a for a in range(A2) if done[a]]
    movers = [a for a in keep if a >= A2]
    st.move(movers, holes)
    cache.move(movers, holes, max(pos_h) + 1)
    order = list(range(A2))
    for h, m in zip(holes, movers):
        order[h] = m
    return [running[a] for a in order], [pos_h[a] for a in order]
