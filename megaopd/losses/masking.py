"""Special-token masking (LSM paper 2603.25562, its code): drop from the loss mask the FIRST occurrence,
in each response, of each configured token id.

Why: the teacher scores the student's first "<think>" pieces and the first "<|im_end|>" as very unlikely
(-19.2 and -58.7 in the paper) although they are correct formatting, and the resulting huge negative
rewards dominate sampled-token OPD (paper: 36.4 -> 40.7 with the masking). Later occurrences keep their
loss. An occurrence counts only where the mask is on (a response token), so prompt tokens never
consume the "first".

    mask_BT = mask_first_occurrences(token_ids_BT, mask_BT, [think_open_id, im_end_id])

Pure function of ids and mask; the trainer applies it once to LossInputs.loss_mask_BT.
"""

from __future__ import annotations

from typing import Sequence

import torch


def mask_first_occurrences(
    token_ids_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    special_ids: Sequence[int],
    seq_ids_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """A copy of mask_BT (same dtype) with the first occurrence of each id of `special_ids` in each
    sequence switched off. Rows are sequences unless seq_ids_BT (packed rows, contiguous segments)."""
    on_BT = mask_BT.bool()
    drop_BT = torch.zeros_like(on_BT)
    if seq_ids_BT is not None:
        # A segment starts where the sequence id changes along the row (or at t = 0).
        start_BT = torch.ones_like(on_BT)
        start_BT[:, 1:] = seq_ids_BT[:, 1:] != seq_ids_BT[:, :-1]
    for special in dict.fromkeys(int(i) for i in special_ids):  # de-duplicated, order kept
        hit_BT = (token_ids_BT == special) & on_BT
        seen_BT = hit_BT.long().cumsum(dim=1)  # occurrences so far in the row, this one included
        if seq_ids_BT is not None:
            # Occurrences before the current segment: the running count just before its start. The
            # running count never decreases, so a cummax carries each start's value over its segment.
            before_start_BT = torch.where(start_BT, seen_BT - hit_BT.long(), torch.zeros_like(seen_BT))
            seen_BT = seen_BT - before_start_BT.cummax(dim=1).values
        drop_BT |= hit_BT & (seen_BT == 1)
    return torch.where(drop_BT, torch.zeros_like(mask_BT), mask_BT)
