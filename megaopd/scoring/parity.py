"""Weight-sync parity: what the engines generate with must be what the actor trained.

    report = parity_report(engine_logprobs, actor_logprobs)      # per-token lists of the probe
    report.check(bounds_for(cfg.parity_dtype(), r.parity_tolerance, r.parity_mean_tolerance,
                            r.parity_p99_tolerance, r.parity_min_correlation))   # RuntimeError naming the statistic

The probe scores fixed sequences (the first prompts' golden solutions) with the engine (its prompt
log-probs, temperature 1) and with the actor (megaopd.scoring.passes) right after a sync, and compares
them token by token. The statistics, and what they mean:
- float32 engines and actor (the CPU path): the two compute the same function in the same precision up to
  summation order, so max |gap| is a few 1e-6 and the bound is tight (rollout.parity_tolerance, 1e-3).
- bf16: one logit ulp at |logit| 16-32 is 0.125, so a correct sync shows max gaps of tenths of a nat on a
  few tokens; max |gap| means nothing. A correct bf16 sync has mean |gap| of about 0.01-0.03 nats and p99
  below about 0.2, and the engine's and the actor's log-probs correlate at 0.99+ (both follow the same
  model). A broken sync (stale weights, a wrong QKV interleave, a missing layer, the wrong dtype cast)
  gives mean gaps of 0.3 to several nats and a correlation that falls well below 0.9: that is what the
  bounds (rollout.parity_mean_tolerance, parity_p99_tolerance, parity_min_correlation) catch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParityBounds:
    """Limits of the probe's statistics; None = not checked."""

    max_abs: float | None = None
    mean_abs: float | None = None
    p99_abs: float | None = None
    min_correlation: float | None = None


@dataclass(frozen=True)
class ParityReport:
    """Engine vs actor log-probs over the probe's tokens."""

    num_tokens: int
    max_abs: float
    mean_abs: float
    p99_abs: float
    correlation: float
    """Pearson correlation of the engine's and the actor's log-probs (1.0 when either is constant)."""

    def line(self) -> str:
        return (
            f"{self.num_tokens} tokens, |engine - actor| log-prob mean {self.mean_abs:.2e}, p99 "
            f"{self.p99_abs:.2e}, max {self.max_abs:.2e}; correlation {self.correlation:.4f}"
        )

    def violations(self, bounds: ParityBounds) -> list[str]:
        out = []
        for name in ("max_abs", "mean_abs", "p99_abs"):
            limit = getattr(bounds, name)
            if limit is not None and getattr(self, name) > limit:
                out.append(f"{name.replace('_abs', '')} |gap| {getattr(self, name):.3g} > {limit}")
        if bounds.min_correlation is not None and self.correlation < bounds.min_correlation:
            out.append(f"correlation {self.correlation:.4f} < {bounds.min_correlation}")
        return out


def parity_report(engine: list[list[float]], actor: list[list[float]]) -> ParityReport:
    """Statistics of the per-token gap; engine[b] and actor[b] are one probe sequence's log-probs."""
    e = torch.tensor([v for row, a in zip(engine, actor) for v in row[: len(a)]], dtype=torch.float64)
    a = torch.tensor([v for row, ar in zip(actor, engine) for v in row[: len(ar)]], dtype=torch.float64)
    if e.numel() == 0:
        return ParityReport(0, 0.0, 0.0, 0.0, 1.0)
    gap = (e - a).abs()
    corr = 1.0
    if e.numel() > 1 and float(e.std()) > 0 and float(a.std()) > 0:
        corr = float(torch.corrcoef(torch.stack([e, a]))[0, 1])
    return ParityReport(int(gap.numel()), float(gap.max()), float(gap.mean()), float(torch.quantile(gap, 0.99)), corr)


def bounds_for(dtype: str, max_abs: float, mean_abs: float, p99_abs: float, min_correlation: float) -> ParityBounds:
    """float32: the tight max bound alone. bf16 / fp16: the statistics that mean something there."""
    if dtype in ("float32", "fp32"):
        return ParityBounds(max_abs=max_abs)
    return ParityBounds(mean_abs=mean_abs, p99_abs=p99_abs, min_correlation=min_correlation)


def check_engine_parity(engine, score_actor, probe: list[list[int]], bounds: ParityBounds, step: int, console) -> None:
    """The probe after a sync (collective): rank 0's engine scores `probe` (its prompt log-probs), every rank
    runs score_actor(probe) (the actor's log-probs of the same tokens), and a RuntimeError names the
    statistics out of `bounds`. Engines without prompt log-probs skip it, saying so on the console."""
    from megaopd.rollout.waits import rank0_waits  # a preemption signal gives rank 0's wait up on every rank

    engine_lp = rank0_waits(
        lambda: [engine.prompt_logprobs(p)[1:] for p in probe] if hasattr(engine, "prompt_logprobs") else None
    )
    if engine_lp is None:
        console(
            "parity check skipped: these engines expose no prompt log-probs; every step's "
            "sync/logprob_gap_* still compares engine and actor log-probs"
        )
        return
    report = parity_report(engine_lp, score_actor(probe))
    problems = report.violations(bounds)
    console(f"weight-sync parity at step {step}: {report.line()}")
    if problems:
        raise RuntimeError(
            f"engine and actor log-probs disagree after the weight sync at step {step}: "
            f"{'; '.join(problems)} ({report.line()}). The sync or the engine's model is broken: "
            f"check the HF <-> Megatron mapping and the engine's dtype (rollout.parity_* set the "
            f"bounds)"
        )
