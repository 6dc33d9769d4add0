"""RolloutBatch: one record carries a step's samples from the engines to the loss.

Shape legend: B sequences, S = padded length of prompt + response, T = S - 1 predicted positions
(position t holds the logits of tokens[:, t] and predicts tokens[:, t + 1]), K top-K support size.
Sequences are right-padded, so causal attention never lets padding reach a real position.

Built on every rank from the same Samples (rank 0 generates and broadcasts them); per-token teacher and
old-policy outputs are filled in by the scoring passes; `select(rows)` cuts out a data-parallel shard
or a micro-batch. Golden (SFT) rows come from megaopd.data.golden_batch.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from megaopd.rollout.protocol import Sample


@dataclass
class RolloutBatch:
    tokens_BS: torch.Tensor
    """prompt + response ids, right-padded with pad_id [B, S] (long)."""
    loss_mask_BT: torch.Tensor
    """1 where position t predicts a response token (t + 1 in the response) [B, T] (float)."""
    engine_logprobs_BT: torch.Tensor
    """The engine's log-prob of the token that position t predicts; 0 outside loss_mask [B, T]."""
    prompt_lens_B: torch.Tensor
    response_lens_B: torch.Tensor
    truncated_B: torch.Tensor
    """1 where the response ran out of budget (finish reason "length") [B] (bool)."""
    group_ids_B: torch.Tensor
    """Index of the prompt each sequence answers (its GRPO group) [B] (long)."""
    old_logprobs_BT: torch.Tensor | None = None
    """log pi_old from the actor's forward-only pass before the update."""
    teacher_logprobs_BT: torch.Tensor | None = None
    teacher_topk_ids_BTK: torch.Tensor | None = None
    teacher_topk_logprobs_BTK: torch.Tensor | None = None
    rewards_B: torch.Tensor | None = None
    """Verifiable reward per sequence (grpo, metrics)."""

    @property
    def size(self) -> int:
        return self.tokens_BS.shape[0]

    @property
    def targets_BT(self) -> torch.Tensor:
        return self.tokens_BS[:, 1:]

    def select(self, rows: torch.Tensor | slice) -> "RolloutBatch":
        """The sub-batch of the given rows (every per-sequence and per-token field)."""
        values = {}
        for f in fields(self):
            v = getattr(self, f.name)
            values[f.name] = v[rows] if isinstance(v, torch.Tensor) else v
        return replace(self, **values)


def build_rollout_batch(samples: list[Sample], pad_id: int, samples_per_prompt: int) -> RolloutBatch:
    """Pads prompt-major samples (n per prompt, as engines return them) into a RolloutBatch."""
    if not samples:
        raise ValueError("no samples to build a batch from: the engines returned nothing")
    B = len(samples)
    S = max(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    tokens_BS = torch.full((B, S), pad_id, dtype=torch.long)
    loss_mask_BT = torch.zeros(B, S - 1)
    engine_logprobs_BT = torch.zeros(B, S - 1)
    for b, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.output_ids)
        tokens_BS[b, :p] = torch.tensor(s.prompt_ids)
        if r == 0:  # an aborted request: the row stays, with nothing to learn from
            continue
        tokens_BS[b, p:p + r] = torch.tensor(s.output_ids)
        # Position t predicts token t + 1: the response tokens p..p+r-1 are predicted at p-1..p+r-2.
        loss_mask_BT[b, p - 1:p + r - 1] = 1.0
        engine_logprobs_BT[b, p - 1:p + r - 1] = torch.tensor(s.output_logprobs, dtype=torch.float32)
    return RolloutBatch(
        tokens_BS=tokens_BS,
        loss_mask_BT=loss_mask_BT,
        engine_logprobs_BT=engine_logprobs_BT,
        prompt_lens_B=torch.tensor([len(s.prompt_ids) for s in samples]),
        response_lens_B=torch.tensor([len(s.output_ids) for s in samples]),
        truncated_B=torch.tensor([s.finish_reason == "length" for s in samples]),
        group_ids_B=torch.arange(B) // samples_per_prompt,
    )
