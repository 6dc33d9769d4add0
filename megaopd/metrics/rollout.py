"""Rollout metrics: truncation, repetition, repetitive-token advantage split, rollout dynamics.

Formulas (docs/algorithms.md, section 2; Stable-OPD paper 2604.08527 sec. 3.2 and figs. 3-4):

- truncation rate = #{responses with finish_reason == "length"} / #responses
- repetition rate: for each response text, tail = text[-L:] (characters),
      CompRatio = len(tail.encode()) / len(zlib.compress(tail.encode(), 9)),
  the response is repetitive when len(text) > L and CompRatio > tau; rate = #repetitive / #responses.
  Paper: L = 10000 characters, tau = 10. A looping response compresses far better than prose
  (prose ~ 2-3x, a 10k-character loop ~ 50-200x), so tau = 10 separates them with a wide margin.
- repetitive token (ours, n = 8): generated token t is repetitive when the n-gram of token ids ending at
  t already ended at an earlier position of the same response. Advantage split: token-mean advantage
  and share of loss tokens over the repetitive and the regular tokens separately.
- rollout dynamics: token-means of student log-prob, teacher log-prob and advantage, and the mean
  response length (in tokens), as in the paper's figure 3.

Pure functions of Python lists / CPU tensors; no distributed code: callers reduce over ranks by
gathering the numerators and denominators (see `*_counts` helpers) or by calling on gathered data.

    from megaopd.metrics import repetition_rate, RepetitionConfig
    repetition_rate(texts, RepetitionConfig(window_chars=2000))
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

# Shape legend: B = responses in the batch, T = padded token positions per response.


@dataclass
class RepetitionConfig:
    """Thresholds for the repetition metrics."""

    window_chars: int = 10000
    """L: characters of the response tail that are compressed; a response must be longer than L to count
    as repetitive (paper: 10000). The tiny CPU preset uses a few hundred: its responses are short."""
    ratio_threshold: float = 10.0
    """tau: a tail whose raw/compressed byte ratio exceeds this is repetitive (paper: 10)."""
    ngram: int = 8
    """n of the repetitive-token test (ours): a token is repetitive when the n-gram ending at it occurred
    earlier in the same response."""

    def __post_init__(self):
        if self.window_chars < 1:
            raise ValueError(f"window_chars={self.window_chars} must be at least 1 character")
        if self.ratio_threshold <= 0:
            raise ValueError(f"ratio_threshold={self.ratio_threshold} must be positive (paper: 10)")
        if self.ngram < 1:
            raise ValueError(f"ngram={self.ngram} must be at least 1 (ours: 8)")


def truncation_rate(finish_reasons: Sequence[str]) -> float:
    """Fraction of responses that ran out of token budget (finish_reason == "length"); 0.0 for none."""
    if len(finish_reasons) == 0:
        return 0.0
    return sum(1 for r in finish_reasons if r == "length") / len(finish_reasons)


def compression_ratio(text: str) -> float:
    """len(b) / len(zlib.compress(b, 9)) with b = text's UTF-8 bytes; 0.0 for an empty text."""
    data = text.encode("utf-8")
    if not data:
        return 0.0
    return len(data) / len(zlib.compress(data, 9))


def is_repetitive(text: str, cfg: RepetitionConfig | None = None) -> bool:
    """len(text) > L and CompRatio(text[-L:]) > tau (lengths in characters, the ratio in bytes)."""
    cfg = cfg or RepetitionConfig()
    if len(text) <= cfg.window_chars:
        return False
    return compression_ratio(text[-cfg.window_chars :]) > cfg.ratio_threshold


def repetition_rate(texts: Sequence[str], cfg: RepetitionConfig | None = None) -> float:
    """Fraction of responses that are repetitive (see `is_repetitive`); 0.0 for none."""
    if len(texts) == 0:
        return 0.0
    cfg = cfg or RepetitionConfig()
    return sum(is_repetitive(t, cfg) for t in texts) / len(texts)


@dataclass(frozen=True)
class ResponseRates:
    """The two rates of one batch of responses that show a collapse (docs/algorithms.md 2.1, 2.2): what the
    collapse detector watches (metrics/collapse.py), one threshold pair per field."""

    truncation_rate: float
    """Share of the responses cut off by the token budget (`truncation_rate`)."""
    repetition_rate: float
    """Share of the responses that repeat themselves (`repetition_rate`)."""

    def log(self, prefix: str = "rollout") -> dict[str, float]:
        """{prefix}/truncation_rate and {prefix}/repetition_rate, as logged."""
        return {f"{prefix}/truncation_rate": self.truncation_rate, f"{prefix}/repetition_rate": self.repetition_rate}


def response_rates(
    texts: Sequence[str], finish_reasons: Sequence[str], cfg: RepetitionConfig | None = None
) -> ResponseRates:
    """The truncation and repetition rates of one batch of responses (one text and finish reason each)."""
    if len(texts) != len(finish_reasons):
        raise ValueError(f"{len(texts)} texts but {len(finish_reasons)} finish reasons: one of each per response")
    return ResponseRates(truncation_rate(finish_reasons), repetition_rate(texts, cfg))


def response_metrics(
    texts: Sequence[str], finish_reasons: Sequence[str], cfg: RepetitionConfig | None = None, prefix: str = "rollout"
) -> dict[str, float]:
    """{prefix}/truncation_rate and {prefix}/repetition_rate of one batch of responses (response_rates, logged)."""
    return response_rates(texts, finish_reasons, cfg).log(prefix)


def repetitive_token_flags(token_ids: Sequence[int], n: int = 8) -> list[bool]:
    """flags[t] = the n-gram token_ids[t-n+1 : t+1] also ended at some position t' < t.

    The first n-1 tokens are never repetitive (no full n-gram ends there). Overlapping occurrences count:
    in a run of one repeated token, every position from n on is repetitive. Linear time (hashed tuples).
    """
    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    ids = list(token_ids)
    seen: set[tuple[int, ...]] = set()
    flags = [False] * len(ids)
    for t in range(n - 1, len(ids)):
        gram = tuple(ids[t - n + 1 : t + 1])
        if gram in seen:
            flags[t] = True
        else:
            seen.add(gram)
    return flags


def repetitive_token_mask(ids_BT: torch.Tensor, response_mask_BT: torch.Tensor, n: int = 8) -> torch.Tensor:
    """Bool [B, T]: True at generated positions whose n-gram repeats an earlier one of the same response.

    response_mask_BT marks each row's generated tokens (all of them, in order; not a loss mask with holes,
    whose gaps would splice unrelated tokens into one n-gram). Prompt and padding positions are False.
    """
    if ids_BT.shape != response_mask_BT.shape:
        raise ValueError(f"ids {tuple(ids_BT.shape)} and response mask {tuple(response_mask_BT.shape)} differ")
    out_BT = torch.zeros(ids_BT.shape, dtype=torch.bool)
    ids_cpu, mask_cpu = ids_BT.detach().cpu(), response_mask_BT.detach().cpu().bool()
    for b in range(ids_cpu.shape[0]):
        pos = mask_cpu[b].nonzero(as_tuple=True)[0]
        flags = repetitive_token_flags(ids_cpu[b, pos].tolist(), n)
        out_BT[b, pos] = torch.tensor(flags, dtype=torch.bool)
    return out_BT.to(ids_BT.device)


def advantage_split_counts(
    adv_BT: torch.Tensor, repetitive_BT: torch.Tensor, mask_BT: torch.Tensor
) -> dict[str, float]:
    """Sums and counts behind `advantage_split`, for reduction over data-parallel ranks before dividing."""
    mask = mask_BT.bool()
    rep = repetitive_BT.bool() & mask
    reg = ~repetitive_BT.bool() & mask
    adv = adv_BT.detach().double()
    return {
        "repetitive_sum": float(adv[rep].sum()),
        "repetitive_count": float(rep.sum()),
        "regular_sum": float(adv[reg].sum()),
        "regular_count": float(reg.sum()),
    }


@dataclass(frozen=True)
class AdvantageSplit:
    """Token-mean advantage and token share of the repetitive and the regular tokens (advantage_split)."""

    repetitive_mean: float
    repetitive_share: float
    regular_mean: float
    regular_share: float

    def log(self, prefix: str = "adv") -> dict[str, float]:
        return {
            f"{prefix}/repetitive_mean": self.repetitive_mean,
            f"{prefix}/repetitive_share": self.repetitive_share,
            f"{prefix}/regular_mean": self.regular_mean,
            f"{prefix}/regular_share": self.regular_share,
        }


def advantage_split_of(c: dict[str, float]) -> AdvantageSplit:
    """Means and shares from (possibly all-reduced) counts (advantage_split_counts' keys). A class with no
    token gets mean 0.0."""
    rep, reg = c["repetitive_count"], c["regular_count"]
    total = rep + reg
    return AdvantageSplit(
        repetitive_mean=c["repetitive_sum"] / rep if rep > 0 else 0.0,
        repetitive_share=rep / total if total > 0 else 0.0,
        regular_mean=c["regular_sum"] / reg if reg > 0 else 0.0,
        regular_share=reg / total if total > 0 else 0.0,
    )


def advantage_split_from_counts(c: dict[str, float], prefix: str = "adv") -> dict[str, float]:
    """Means and shares from (possibly all-reduced) counts, logged (advantage_split_of)."""
    return advantage_split_of(c).log(prefix)


def advantage_split(
    adv_BT: torch.Tensor, repetitive_BT: torch.Tensor, mask_BT: torch.Tensor, prefix: str = "adv"
) -> dict[str, float]:
    """Token-mean advantage and token share of repetitive vs regular tokens among masked (loss) tokens.

    adv/repetitive_mean = sum_{t: rep & mask} A_t / #{rep & mask}; adv/repetitive_share = #{rep & mask} / #mask;
    likewise for regular (= not repetitive). The paper's figure 4: under plain OPD repetitive tokens get
    a higher advantage than regular ones (the teacher finds a loop predictable), which feeds the collapse.
    """
    return advantage_split_from_counts(advantage_split_counts(adv_BT, repetitive_BT, mask_BT), prefix)


def rollout_dynamics_counts(
    mask_BT: torch.Tensor,
    student_logprobs_BT: torch.Tensor | None = None,
    teacher_logprobs_BT: torch.Tensor | None = None,
    adv_BT: torch.Tensor | None = None,
) -> dict[str, float]:
    """Sums over masked tokens (and the token count) behind `rollout_dynamics`' token-means, for reduction
    over data-parallel ranks before dividing; a tensor passed as None is left out."""
    mask = mask_BT.bool()
    out = {"tokens": float(mask.sum())}
    for name, x in (
        ("student_logprob", student_logprobs_BT),
        ("teacher_logprob", teacher_logprobs_BT),
        ("advantage", adv_BT),
    ):
        if x is not None:
            out[f"{name}_sum"] = float(x.detach().double()[mask].sum())
    return out


def rollout_dynamics_from_counts(
    response_lengths: Sequence[int] | torch.Tensor, c: dict[str, float], prefix: str = "rollout"
) -> dict[str, float]:
    """Mean response length (per response) and the token-means from (possibly reduced) counts; no token: 0.0."""
    lengths = torch.as_tensor(response_lengths, dtype=torch.float64)
    out = {f"{prefix}/response_length_mean": float(lengths.mean()) if lengths.numel() else 0.0}
    n = c["tokens"]
    for name in ("student_logprob", "teacher_logprob", "advantage"):
        if f"{name}_sum" in c:
            out[f"{prefix}/{name}_mean"] = c[f"{name}_sum"] / n if n > 0 else 0.0
    return out


def rollout_dynamics(
    response_lengths: Sequence[int] | torch.Tensor,
    mask_BT: torch.Tensor,
    student_logprobs_BT: torch.Tensor | None = None,
    teacher_logprobs_BT: torch.Tensor | None = None,
    adv_BT: torch.Tensor | None = None,
    prefix: str = "rollout",
) -> dict[str, float]:
    """Mean response length (per response) and token-means (over mask) of the given per-token tensors.

    Keys: {prefix}/response_length_mean, /student_logprob_mean, /teacher_logprob_mean, /advantage_mean;
    a tensor passed as None is left out.
    """
    return rollout_dynamics_from_counts(
        response_lengths, rollout_dynamics_counts(mask_BT, student_logprobs_BT, teacher_logprobs_BT, adv_BT), prefix
    )
