"""Student/teacher top-k agreement at student-visited prefixes (paper 2604.13016), k = 16.

For each generated position t with student distribution p = pi_theta(.|s_t) and teacher q(.|s_t):
    overlap ratio  = |TopK(p) n TopK(q)| / k
    overlap mass   = sum_{v in TopK(p) n TopK(q)} p(v)         (the student's mass on the shared support)
    entropy gap    = |H(q) - H(p)|
each token-averaged over the mask. Inputs are the top-k ids and log-probs (full-vocabulary log-softmax)
that ops/ computes vocab-parallel, and the entropies; nothing here touches full-vocabulary logits.

    topk_overlap(s_ids_TK, s_lp_TK, t_ids_TK, mask_T, student_entropy_T=hs, teacher_entropy_T=ht)
"""

from __future__ import annotations

import torch

# Shape legend: T = tokens (any leading shape flattens to it), K = k of top-k.


def topk_overlap_counts(
    student_ids_TK: torch.Tensor,
    student_logprobs_TK: torch.Tensor,
    teacher_ids_TK: torch.Tensor,
    mask_T: torch.Tensor | None = None,
    student_entropy_T: torch.Tensor | None = None,
    teacher_entropy_T: torch.Tensor | None = None,
) -> dict[str, float]:
    """Sums over masked tokens (and the token count) behind `topk_overlap`, for cross-rank reduction."""
    if student_ids_TK.shape != teacher_ids_TK.shape or student_ids_TK.shape != student_logprobs_TK.shape:
        raise ValueError(
            f"top-k shapes differ: student ids {tuple(student_ids_TK.shape)}, student log-probs "
            f"{tuple(student_logprobs_TK.shape)}, teacher ids {tuple(teacher_ids_TK.shape)}; pass the same k for both"
        )
    k = student_ids_TK.shape[-1]
    s_ids = student_ids_TK.reshape(-1, k)
    t_ids = teacher_ids_TK.reshape(-1, k)
    s_lp = student_logprobs_TK.reshape(-1, k).detach().double()
    mask = torch.ones(s_ids.shape[0], dtype=torch.bool) if mask_T is None else mask_T.reshape(-1).bool().cpu()
    # shared_TK[t, i]: the student's i-th top id is also among the teacher's top-k. [T, K, 1] == [T, 1, K].
    shared_TK = (s_ids.unsqueeze(-1) == t_ids.unsqueeze(-2)).any(-1).cpu()
    ratio_T = shared_TK.double().sum(-1) / k
    mass_T = (s_lp.exp().cpu() * shared_TK).sum(-1)
    out = {"count": float(mask.sum()), "ratio_sum": float(ratio_T[mask].sum()), "mass_sum": float(mass_T[mask].sum())}
    if student_entropy_T is not None and teacher_entropy_T is not None:
        gap_T = (teacher_entropy_T.reshape(-1).double() - student_entropy_T.reshape(-1).double()).abs().cpu()
        out["entropy_gap_sum"] = float(gap_T[mask].sum())
    return out


def topk_overlap_from_counts(c: dict[str, float], prefix: str = "overlap") -> dict[str, float]:
    n = c["count"]
    out = {
        f"{prefix}/ratio": c["ratio_sum"] / n if n > 0 else 0.0,
        f"{prefix}/mass": c["mass_sum"] / n if n > 0 else 0.0,
    }
    if "entropy_gap_sum" in c:
        out[f"{prefix}/entropy_gap"] = c["entropy_gap_sum"] / n if n > 0 else 0.0
    return out


def topk_overlap(
    student_ids_TK: torch.Tensor,
    student_logprobs_TK: torch.Tensor,
    teacher_ids_TK: torch.Tensor,
    mask_T: torch.Tensor | None = None,
    student_entropy_T: torch.Tensor | None = None,
    teacher_entropy_T: torch.Tensor | None = None,
    prefix: str = "overlap",
) -> dict[str, float]:
    """Token-means over mask of overlap ratio, overlap mass and (given both entropies) entropy gap.

    Ids within one row are assumed distinct (they are a top-k). Keys: {prefix}/ratio, /mass, /entropy_gap.
    """
    return topk_overlap_from_counts(
        topk_overlap_counts(
            student_ids_TK, student_logprobs_TK, teacher_ids_TK, mask_T, student_entropy_T, teacher_entropy_T
        ),
        prefix,
    )
