"""How the embedded engine decodes a chunk of rows with a KV cache (no locks here: the runner holds the model).

The distinct prompts are left-padded and prefilled once (a prompt's n samples share its prefill; the KV
cache rows are then repeated), then one token per row per step with a DynamicCache; rows that finish are
dropped from the batch and the cache. Each row draws from its own torch.Generator (seeded from
RowRequest.seed), so a seeded result does not depend on which other rows were in the batch (up to float
reductions, which batch size can change in the last bit).

Between two steps decode_rows asks its `boundary` what to do next: "go" on, "retract" (re-prefill every
running row, prompt + tokens so far, under what may be new weights), or "abort" (the running rows end
with finish reason "abort"). The runner's boundary is where a pause, an abort or a weight load intervenes.

Legend: S sequences of a prefill, U distinct prompts, B rows of the chunk, A rows still running,
L padded length, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from megaopd.engine.rows import RowRequest, RowResult
from megaopd.engine.sampling import row_generator, sample_tokens

StepAction = Literal["go", "retract", "abort"]


@dataclass
class Forward:
    """The model and how to call it: its device, the id that pads prompts, and forward's cache keyword."""

    model: Any
    """An HF causal LM (transformers' AutoModelForCausalLM)."""
    device: torch.device
    pad_id: int
    cache_kw: str
    """transformers 5.2x renamed forward's `past_key_values` to `cache` (the old name warns on every call
    and goes in 5.40); older releases know only the old name."""

    def prefill(self, seqs: list[list[int]]):
        """Left-pads and runs the sequences; returns (cache, last logits [S, V], mask [S, L], next positions [S])."""
        from transformers import DynamicCache

        L = max(len(s) for s in seqs)
        ids_SL = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        mask_SL = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids_SL[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
            mask_SL[i, L - len(s):] = 1
        ids_SL, mask_SL = ids_SL.to(self.device), mask_SL.to(self.device)
        # Positions count real tokens only, so a left-padded prompt sees the same RoPE phases as unpadded.
        pos_SL = (mask_SL.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids_SL, attention_mask=mask_SL, position_ids=pos_SL, use_cache=True,
                         logits_to_keep=1, **{self.cache_kw: cache})
        return cache, out.logits[:, -1, :].float(), mask_SL, pos_SL[:, -1] + 1

    def step(self, cache, tokens_A: torch.Tensor, mask_AL: torch.Tensor, next_pos_A: torch.Tensor):
        """One token per running row; returns (logits [A, V], mask [A, L + 1], next positions [A]).
        The cache object is updated in place."""
        mask_AL = torch.cat([mask_AL, torch.ones_like(mask_AL[:, :1])], dim=1)
        out = self.model(input_ids=tokens_A.unsqueeze(-1), attention_mask=mask_AL,
                         position_ids=next_pos_A.unsqueeze(-1), use_cache=True, **{self.cache_kw: cache})
        return out.logits[:, -1, :].float(), mask_AL, next_pos_A + 1


@torch.inference_mode()
def decode_rows(fwd: Forward, rows: list[RowRequest], weight_version: str,
                boundary: Callable[[], StepAction]) -> list[RowResult]:
    """Generates every row of one chunk; results in row order, each tagged with weight_version."""
    B, device = len(rows), fwd.device
    results = [RowResult(weight_version=weight_version) for _ in rows]
    gens = [row_generator(r.seed if r.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
            for r in rows]
    # Prefill each distinct prompt once, then repeat its cache rows for its samples.
    unique: dict[tuple[int, ...], int] = {}
    row_to_u = [unique.setdefault(tuple(r.prompt_ids), len(unique)) for r in rows]
    cache, logits_UV, mask_UL, next_pos_U = fwd.prefill([list(p) for p in unique])
    idx_B = torch.tensor(row_to_u, device=device)
    cache.batch_select_indices(idx_B)
    logits_AV, mask_AL, next_pos_A = logits_UV[idx_B], mask_UL[idx_B], next_pos_U[idx_B]

    active = list(range(B))  # original row index of each batch position
    temp_B = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=device)
    top_p_B = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device)
    top_k_B = torch.tensor([r.top_k for r in rows], dtype=torch.long, device=device)
    min_p_B = torch.tensor([r.min_p for r in rows], dtype=torch.float32, device=device)
    while True:
        a_idx = torch.tensor(active, device=device)
        ids_A, lps_A = sample_tokens(logits_AV, temp_B[a_idx], top_p_B[a_idx], top_k_B[a_idx],
                                     [gens[i] for i in active], min_p_B[a_idx])
        keep: list[int] = []  # batch positions still running
        for pos, (row, tok, lp) in enumerate(zip(active, ids_A.tolist(), lps_A.tolist())):
            res, req = results[row], rows[row]
            res.output_ids.append(tok)
            res.logprobs.append(lp)
            if tok in req.stop_ids:
                res.finish_reason, res.matched = "stop", tok
            elif len(res.output_ids) >= req.max_new_tokens:
                res.finish_reason = "length"
            else:
                keep.append(pos)
        if not keep:
            break
        new_tokens_A = ids_A
        if len(keep) < len(active):
            k_idx = torch.tensor(keep, device=device)
            cache.batch_select_indices(k_idx)
            mask_AL, next_pos_A, new_tokens_A = mask_AL[k_idx], next_pos_A[k_idx], ids_A[k_idx]
            active = [active[p] for p in keep]
        action = boundary()
        if action == "abort":
            for row in active:
                results[row].finish_reason = "abort"
            break
        if action == "retract":
            # Recompute the KV cache of every running row under the (possibly new) weights.
            seqs = [rows[row].prompt_ids + results[row].output_ids for row in active]
            cache, logits_AV, mask_AL, next_pos_A = fwd.prefill(seqs)
        else:
            logits_AV, mask_AL, next_pos_A = fwd.step(cache, new_tokens_A, mask_AL, next_pos_A)
    return results
