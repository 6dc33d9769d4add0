"""Losses under a teacher with another tokenizer (issue 46): the span reward of opd, and which losses refuse.

The teacher scores its own tokens of the student's response text; megaopd.data.alignment groups both
tokenizations into spans (a span ends where both have a token boundary) and puts each span's summed teacher
log-prob on its student tokens, spread evenly (LossInputs.teacher_logprobs_BT), with the span index of each
position (LossInputs.teacher_spans_BT, numbered per sequence; -1: no span).

Span reward and advantage (opd, and stable_opd's opd term), for span s of a response with student tokens
t in s that count in the loss (loss mask on):
    R_s = sum_{t in s} (q~_t - log pi_old(y_t|s_t)) = log q(text of s | prefix) - log pi_old(text of s | prefix)
          (q~_t: the spread teacher log-probs; over a whole span they sum to the teacher's span log-prob)
    A_t = c * G_{last(s)} for every t in s,   G = the discounted return over positions of the rewards placed
          at each span's last counted token (gamma = 0, the default: A_t = c * R_s)
    r_t = q~_t - log pi_old(y_t|s_t)   (per-token reward for the metrics: sums to R_s over the span)
A span is one action: every token of it gets the whole span's advantage, so the span's policy-gradient
term is the sum of its tokens' terms, R_s * sum_{t in s} grad log pi(y_t) = R_s * grad log pi(span text):
the score function of the span, weighted once per student token under token-mean (a span of 3 student
tokens weighs like 3 tokens of a same-tokenizer teacher; spreading R_s / n instead would make it weigh 1).
Positions with no span (-1: special tokens, whose markup the other side never sees) get reward and advantage
0. Tokens outside the loss mask (special-token masking, environment turns) add nothing to R_s: as
same-tokenizer opd, a masked token cannot leak its teacher score into its neighbours; a span partly masked
then compares only the teacher's share of its counted tokens (an approximation, spread evenly). Spans None:
every token is its own span, and the numbers are exactly same-tokenizer opd's.

Exact vs approximate: R_s is the exact log-ratio of the span's text under teacher and student (both given
the same preceding text; each side's probability of its own tokens of that text); the per-token split of the
teacher's span log-prob (even spread) only shapes the per-token reward metric, never the advantage.
Full-distribution losses (gkd, lsm) compare distributions over ONE vocabulary and are refused
(check_cross_tokenizer); GOLD's hybrid (exact KL over shared tokens + ULD's sorted-probability distance over
the rest) is not implemented.

    pytest tests/losses -k span
"""

from __future__ import annotations

from typing import Any

import torch


def check_cross_tokenizer(loss_name: str, config: Any = None) -> None:
    """Raises ValueError, in one line naming the loss and what to choose instead, when `loss_name` (with its
    config: a weighted_sum's terms) reads the teacher's distribution over the student's vocabulary, which a
    teacher with another tokenizer does not have. The config loader calls it when teacher.tokenizer=own."""
    from megaopd.losses.registry import build_loss

    needs = build_loss(loss_name, config).needs
    reads = [
        what
        for what, needed in (
            ("its top-K ids and log-probs", needs.teacher_topk),
            ("its log-probs at the student's top-k ids", needs.student_topk),
            ("its full logits", needs.teacher_logits),
        )
        if needed
    ]
    if reads:
        raise ValueError(
            f"loss {loss_name!r} reads the teacher's {' and '.join(reads)} over the student's vocabulary, which a "
            f"teacher with another tokenizer (teacher.tokenizer=own) does not have: choose loss opd or stable_opd "
            f"(reverse KL over aligned text spans), or a teacher with the student's tokenizer"
        )


def span_groups(spans_BT: torch.Tensor, seq_ids_BT: torch.Tensor, valid_BT: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Group index of each position (its (sequence, span) pair) [B, T] long, -1 where not valid, and the
    number of groups. Spans are numbered per sequence, so packed sequences' span 0s are distinct groups."""
    # A sequence has fewer spans than positions: T + 1 separates the sequences' keys (and reads nothing back).
    key_BT = seq_ids_BT.long() * (spans_BT.shape[-1] + 1) + spans_BT.long().clamp(min=0)
    groups, inverse = torch.unique(key_BT[valid_BT], return_inverse=True)
    group_BT = torch.full_like(key_BT, -1)
    group_BT[valid_BT] = inverse
    return group_BT, int(groups.numel())


def place_at_span_ends(
    rewards_BT: torch.Tensor, spans_BT: torch.Tensor, seq_ids_BT: torch.Tensor, valid_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(placed_BT, end_BT): each span's summed reward at the span's last valid position (0 elsewhere), and for
    every position the flat index (into [B * T]) of its span's last valid position, -1 where not valid.
    rewards_BT must be 0 where not valid. Then A = take_at_span_ends(discounted_returns(placed_BT, ...), end_BT)
    is the module docstring's G_{last(s)} on every token of s."""
    group_BT, n = span_groups(spans_BT, seq_ids_BT, valid_BT)
    on = group_BT >= 0
    slot = torch.where(on, group_BT, n).reshape(-1)  # slot n collects the positions of no span
    R = rewards_BT.new_zeros(n + 1).index_add(0, slot, rewards_BT.reshape(-1))
    position = torch.arange(rewards_BT.numel(), device=rewards_BT.device)
    last = torch.full((n + 1,), -1, dtype=torch.long, device=rewards_BT.device)
    last = last.scatter_reduce(0, slot, position, reduce="amax")
    placed = rewards_BT.new_zeros(rewards_BT.numel())
    placed[last[:n]] = R[:n]
    end_BT = torch.where(on, last[slot].reshape(rewards_BT.shape), torch.full_like(group_BT, -1))
    return placed.reshape(rewards_BT.shape), end_BT


def take_at_span_ends(x_BT: torch.Tensor, end_BT: torch.Tensor) -> torch.Tensor:
    """x at each position's span end (place_at_span_ends' end_BT); 0 where a position has no span."""
    flat = x_BT.reshape(-1)[end_BT.clamp(min=0).reshape(-1)].reshape(x_BT.shape)
    return torch.where(end_BT >= 0, flat, torch.zeros_like(flat))
