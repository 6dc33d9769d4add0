"""The step's logged metrics beyond the loss's own: training dynamics of the rollouts
(docs/algorithms.md section 2), the engine/actor log-prob gap, the reduction of the micro-batches'
loss metrics over the data-parallel ranks, and the step's FLOPs and MFU (perf/*).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megaopd.metrics import repetitive_token_mask, response_rates, trajectory_metrics
from megaopd.metrics.config import MetricsConfig
from megaopd.metrics.flops import MatmulDims, StepWork, peak_tflops, step_flops
from megaopd.metrics.overlap import topk_overlap_counts, topk_overlap_from_counts
from megaopd.metrics.rollout import (
    ResponseRates,
    advantage_split_counts,
    advantage_split_of,
    rollout_dynamics_counts,
    rollout_dynamics_from_counts,
)
from megaopd.parallel.dist import device as group_device
from megaopd.parallel.dist import rank0_computes
from megaopd.rollout.records import RolloutBatch
from megaopd.scoring.teachers import teacher_metric_sums, teacher_metrics_from_sums

if TYPE_CHECKING:  # annotations only: config composes every package's section, so no package imports it
    from megaopd.config.schema import MegaOPDConfig
    from megaopd.losses import LossResult
    from megaopd.losses.needs import LossNeeds
    from megaopd.trainer.roles import Models


@dataclass(frozen=True, kw_only=True)
class RolloutSignals:
    """What one step's rollouts tell the parts that steer the run: the adaptive loss controller
    (trainer/loss_control.py) and the collapse detector (Trainer._log). Typed, so a renamed metric cannot
    leave them reading a default; their log names are given in one place, log()."""

    truncation_rate: float
    """Share of responses cut off by the token budget (docs/algorithms.md 2.1)."""
    repetition_rate: float
    """Share of responses that repeat themselves (2.2)."""
    reward_mean: float
    """Mean reward of the step's responses."""
    adv_regular_mean: float | None = None
    """Mean reverse-KL advantage over regular tokens (2.3); None without a teacher."""
    adv_repetitive_mean: float | None = None
    """Mean advantage over tokens inside repeated n-grams; None without a teacher."""
    repetitive_token_share: float | None = None
    """Share of the response tokens inside repeated n-grams; None without a teacher."""

    def log(self) -> dict[str, float]:
        """The logged metric of each field (metrics.jsonl, TensorBoard, the step line)."""
        out = {
            "rollout/truncation_rate": self.truncation_rate,
            "rollout/repetition_rate": self.repetition_rate,
            "rollout/reward_mean": self.reward_mean,
        }
        if self.adv_regular_mean is not None:
            out.update(
                {
                    "adv/regular_mean": self.adv_regular_mean,
                    "adv/repetitive_mean": self.adv_repetitive_mean,
                    "adv/repetitive_token_share": self.repetitive_token_share,
                }
            )
        return out

    def rates(self) -> ResponseRates:
        """The rates the collapse detector watches (metrics/collapse.py)."""
        return ResponseRates(truncation_rate=self.truncation_rate, repetition_rate=self.repetition_rate)


@dataclass(frozen=True)
class RolloutMetrics:
    """rollout_metrics' answer: every metric to log, and the typed signals among them."""

    log: dict[str, float]
    signals: RolloutSignals


@dataclass(frozen=True)
class StepLoss:
    """The step's loss over every micro-batch and data-parallel rank (reduce_loss_metrics)."""

    total: float
    """The step loss: the sum of the micro-batches' shares (each divides by the step's global count)."""
    terms: dict[str, float]
    """label -> the unweighted term over the step, summed the same way (a single loss: its name)."""
    metrics: dict[str, float]
    """The losses' own metrics ("<label>/<what>"), averaged over micro-batches and ranks."""

    def log(self) -> dict[str, float]:
        """loss/total, loss/<label> for each term, then the losses' own metrics under their names."""
        return {"loss/total": self.total, **{f"loss/{k}": v for k, v in self.terms.items()}, **self.metrics}


@dataclass(frozen=True, kw_only=True)
class TrainMetrics:
    """Trainer._train's answer: the loss over the step and the optimizer's metrics."""

    loss: StepLoss | None
    """reduce_loss_metrics (None: no micro-batch anywhere held a loss)."""
    grad_norm: float
    """Mean gradient norm over the step's updates."""
    lr: float
    """Mean learning rate of the step's updates."""
    skipped_nonfinite: int | None = None
    """Updates skipped for a non-finite loss or gradient (None: trainer.skip_nonfinite off, not logged)."""

    def log(self) -> dict[str, float]:
        out = self.loss.log() if self.loss is not None else {}
        out["train/grad_norm"], out["train/lr"] = self.grad_norm, self.lr
        if self.skipped_nonfinite is not None:
            out["train/skipped_nonfinite"] = self.skipped_nonfinite
        return out


@dataclass(frozen=True, kw_only=True)
class StepTimes:
    """The step's phase times in seconds, the slowest rank's: StepTimes(**Timer.reduce(...)), so a phase timed
    under a name this record does not have fails at its first step (add the field). None: not timed this step."""

    rollout: float | None = None
    """Generation, with the passes that score its parts as they arrive (trainer/rollout_stage.py)."""
    actor_logprobs: float | None = None
    """The actor's scoring pass after the rollout."""
    teacher: float | None = None
    """The in-job teachers' passes and the wait for the served ones."""
    teacher_remote: float | None = None
    """The served teachers' requests (rank 0's threads, overlapped with actor_logprobs)."""
    train: float | None = None
    """Forward, backward and the optimizer steps of the step's mini-batches."""
    sync: float | None = None
    """The weight push to the engines (sync mode: after the step; overlapped: before the next batch)."""
    step: float
    """The whole step."""

    def log(self) -> dict[str, float]:
        """time/<phase> -> seconds of each timed phase, as logged."""
        return {f"time/{f.name}": v for f in fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What Trainer.train_step tells the loop: each producer's record. `log()` makes the step's metrics row, once,
    where the run log is written; nothing before it reads a metric by name."""

    train: TrainMetrics
    controller: dict[str, float]
    """The adaptive loss controller's controller/* (ControlledLoss.observe; empty when fixed)."""
    rollout: RolloutMetrics | None
    """The rollouts' metrics and signals (None: an SFT step)."""
    flow: dict[str, float]
    """Rank 0: the rollout flow's pipeline/* (RolloutFlow.report; the log keeps its older names), its weight
    syncs' sync/* (RolloutFlow.sync_log) and the served teachers' share scored part by part; empty on the other
    ranks, which do not log them."""
    times: StepTimes
    flops: dict[str, float]
    """flop_metrics: flops/* and perf/*."""
    validation: dict[str, float] = field(default_factory=dict)
    """val/* when the step validated (Trainer.train adds them)."""
    logs_rollout: bool = True
    """This rank logs the rollouts' metrics (rank 0, which holds the texts)."""

    @property
    def signals(self) -> RolloutSignals | None:
        """What the collapse detector reads (None: an SFT step)."""
        return self.rollout.signals if self.rollout is not None else None

    def log(self) -> dict[str, float]:
        """The step's metrics.jsonl row (without step and time), in the order the run log has always had."""
        out = self.train.log()
        out.update(self.controller)
        if self.rollout is not None and self.logs_rollout:
            out.update(self.rollout.log, **self.flow)
        out.update(self.times.log())
        out.update(self.flops)
        out.update(self.validation)
        return out


def rollout_metrics(batch: RolloutBatch, mcfg: MetricsConfig, contributes: bool = True) -> RolloutMetrics:
    """Truncation, repetition, dynamics, the repetitive/regular advantage split, top-k overlap, and the
    engine/actor log-prob gap (the first sign of a broken weight sync) of one step's rollouts.

    Each rank holds its owned rows' scores (batch.actor.rows): it sums over them, and one all_gather of a
    small float64 vector of sums, counts and maxima (collective over the world; `contributes`: this rank
    speaks for its actor replica, RowOwners.sends, the others send zeros) gives the whole batch's token-means,
    the same definitions as over the whole batch at once. Lengths and rewards are on every rank; the
    truncation and repetition rates come from rank 0, which holds the texts."""
    actor, teacher = batch.actor, batch.teacher
    rows = actor.rows if actor.rows is not None else list(range(batch.size))
    idx = torch.tensor(rows, dtype=torch.long)
    batch.check_held(idx, "the rollout metrics")
    mask = batch.loss_mask_BT[idx]  # every generated token (repetitive n-grams need them all; a trajectory: its turns)
    m = mask.bool()
    a = actor.index(rows)
    t = teacher.index(rows) if teacher is not None else None
    a_lp = actor.logprobs_BT[a]
    t_lp = teacher.logprobs_BT[t] if teacher is not None else None
    adv_BT = (t_lp - a_lp) * mask if teacher is not None else None
    # The top-k overlap: none from a cross-tokenizer teacher (it sends no top-k ids).
    overlap = bool(mcfg.overlap_k) and teacher is not None and teacher.topk_ids_BTK is not None
    sums = {f"dyn/{k}": v for k, v in rollout_dynamics_counts(mask, a_lp, t_lp, adv_BT).items()}
    if teacher is not None:
        rep_BT = repetitive_token_mask(batch.targets_BT[idx], mask, mcfg.repetition.ngram)
        sums.update({f"split/{k}": v for k, v in advantage_split_counts(adv_BT, rep_BT, mask).items()})
        if overlap:
            k = mcfg.overlap_k
            ent = (
                (actor.entropy_BT[a], teacher.entropy_BT[t])
                if actor.entropy_BT is not None and teacher.entropy_BT is not None
                else (None, None)
            )
            sums.update(
                {
                    f"overlap/{k_}": v
                    for k_, v in topk_overlap_counts(
                        actor.topk_ids_BTK[a][..., :k],
                        actor.topk_logprobs_BTK[a][..., :k],
                        teacher.topk_ids_BTK[t][..., :k],
                        mask,
                        *ent,
                    ).items()
                }
            )
        if len(batch.teacher_rows) > 1:  # several teachers: their metrics apart too
            sums.update({f"teacher/{k_}": v for k_, v in teacher_metric_sums(batch, batch.teacher_rows).items()})
    gap = (batch.engine_logprobs_BT[idx] - a_lp).abs()[m]
    sums["gap_sum"] = float(gap.double().sum())
    gap_max = float(gap.max()) if gap.numel() else float("-inf")
    c, gap_max = _sum_over_owners(sums, gap_max, contributes)

    rates = _text_rates(batch, mcfg)
    out: dict[str, float] = {}
    # The student's tokens only: a trajectory's environment turns are not the student's response length.
    out.update(rollout_dynamics_from_counts(batch.student_lens_B, _with_prefix(c, "dyn/")))
    if batch.trajectories is not None:
        tr = batch.trajectories
        out.update(
            trajectory_metrics(
                [t.turns for t in tr],
                [t.tool_calls for t in tr],
                [t.tool_errors for t in tr],
                [t.truncated_by for t in tr],
                batch.student_lens_B.tolist(),
                batch.response_lens_B.tolist(),
            )
        )
    n = c["dyn/tokens"]
    split = advantage_split_of(_with_prefix(c, "split/")) if teacher is not None else None
    signals = RolloutSignals(
        truncation_rate=rates.truncation_rate,
        repetition_rate=rates.repetition_rate,
        reward_mean=float(batch.rewards_B.mean()),
        adv_regular_mean=split.regular_mean if split is not None else None,
        adv_repetitive_mean=split.repetitive_mean if split is not None else None,
        repetitive_token_share=split.repetitive_share if split is not None else None,
    )
    out.update(signals.log())
    if teacher is not None:
        if overlap:
            out.update(topk_overlap_from_counts(_with_prefix(c, "overlap/")))
        if len(batch.teacher_rows) > 1:
            out.update(teacher_metrics_from_sums(_with_prefix(c, "teacher/"), batch.teacher_rows, batch.size))
    out["sync/logprob_gap_mean"] = c["gap_sum"] / n if n > 0 else 0.0
    out["sync/logprob_gap_max"] = gap_max if n > 0 else 0.0
    return RolloutMetrics(log=out, signals=signals)


def _with_prefix(c: dict[str, float], prefix: str) -> dict[str, float]:
    """The entries of c whose key starts with prefix, the prefix taken off."""
    return {k[len(prefix) :]: v for k, v in c.items() if k.startswith(prefix)}


def _text_rates(batch: RolloutBatch, mcfg: MetricsConfig) -> ResponseRates:
    """Truncation and repetition rates on every rank (the adaptive controller reads them on each), made on
    rank 0: it decoded the texts. Collective in a distributed job."""
    args = (batch.texts, batch.finish_reasons, mcfg.repetition)
    return rank0_computes(response_rates, *args) if dist.is_initialized() else response_rates(*args)


def _sum_over_owners(sums: dict[str, float], maximum: float, contributes: bool) -> tuple[dict[str, float], float]:
    """Sums over the world of each key (every rank passes the same keys in the same order) and the max of
    `maximum`: one all_gather of a [len(sums) + 1] float64 vector. Non-contributing ranks count as zero."""
    values = list(sums.values()) if contributes else [0.0] * len(sums)
    vec = torch.tensor(values + [maximum if contributes else float("-inf")], dtype=torch.float64, device=group_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.empty_like(vec) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, vec)
        table = torch.stack(parts).cpu()
    else:
        table = vec.cpu().unsqueeze(0)
    total = table[:, :-1].sum(0).tolist()
    return dict(zip(sums, total)), float(table[:, -1].max())


def reduce_loss_metrics(results: list[LossResult], is_reporter: bool) -> StepLoss | None:
    """The step's loss on every rank: the micro-batches' total and term shares are summed (each already
    divides by the step's global count), their metrics averaged over micro-batches and DP ranks. Reporters:
    the last pipeline stage's TP rank 0 of each DP replica (collective over the world). None: no results."""
    local = [_floats(r) for r in results] if is_reporter else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = [m for part in gathered for m in part]
    if not merged:
        return None
    terms = {k: sum(m.terms[k] for m in merged if k in m.terms) for k in merged[0].terms}
    metrics = {}
    for key in merged[0].metrics:
        values = [m.metrics[key] for m in merged if key in m.metrics]
        metrics[key] = sum(values) / len(values)
    return StepLoss(sum(m.total for m in merged), terms, metrics)


def _floats(result: LossResult) -> StepLoss:
    """One micro-batch's record as Python floats (what all_gather_object sends)."""
    return StepLoss(
        float(result.total),
        {k: float(v) for k, v in result.terms.items()},
        {k: float(v) for k, v in result.metrics.items()},
    )


def sample_rows(batch: RolloutBatch, tokenizer, n: int) -> list[dict]:
    """The first n responses of the step as RUN/samples/step_N.jsonl rows."""
    return [
        {
            "prompt": tokenizer.decode(batch.tokens_BS[b, : int(batch.prompt_lens_B[b])].tolist()),
            "response": batch.texts[b],
            "finish_reason": batch.finish_reasons[b],
            "reward": float(batch.rewards_B[b]),
        }
        for b in range(min(n, batch.size))
    ]


def step_work(models: Models, needs: LossNeeds, cfg: MegaOPDConfig, rollout: RolloutBatch | None, golden) -> StepWork:
    """What the step ran, for its FLOPs (megaopd.metrics.flops): the trained sequences (rollouts and golden
    rows), the actor's and an in-job teacher's scoring passes (a served teacher's run elsewhere; the teacher
    is taken to see the student's lengths), the lockstep partner, the recomputation and the fused output layer."""
    student = MatmulDims.of(models.actor.hf)
    scored = (rollout.prompt_lens_B + rollout.response_lens_B).tolist() if rollout is not None else []
    golden_S = golden.attention_mask_BT.sum(-1).tolist() if golden is not None else []
    teacher = MatmulDims.of(models.teacher.hf) if models.teacher is not None else None
    partner = student if needs.reference else teacher if needs.teacher_logits else None
    return StepWork(
        student,
        scored + golden_S,
        scored,
        teacher,
        scored if teacher is not None else [],
        partner,
        cfg.student.recompute,
        cfg.trainer.logits_chunk_tokens > 0,
    )


def flop_metrics(work: StepWork, times: StepTimes) -> dict[str, float]:
    """The step's model and hardware FLOPs (flops/*, all ranks), the TFLOP/s per GPU they make (perf/*) and,
    on a GPU of known peak, MFU: perf/mfu_model_train (6N per trained token + attention, over the
    training phase's time), perf/mfu_hardware_train (+ recomputation and the lockstep partner's forward),
    perf/mfu_model_step (the scoring passes too, over the whole step's time). Times: the timer's (the
    slowest rank's); every rank's GPU counts."""
    f = step_flops(work)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    # flops/*: counts, deterministic; perf/*: rates, wall-clock (the golden test skips them like time/*).
    out = {
        "flops/model_train": f.model_train,
        "flops/hardware_train": f.hardware_train,
        "flops/model_step": f.model,
        "flops/hardware_step": f.hardware,
    }
    t_train, t_step = times.train, times.step
    if not t_train or not t_step:
        return out
    per_gpu = {
        "model_train": f.model_train / t_train,
        "hardware_train": f.hardware_train / t_train,
        "model_step": f.model / t_step,
    }
    out.update({f"perf/{k}_tflops_per_gpu": v / world_size / 1e12 for k, v in per_gpu.items()})
    peak = peak_tflops(torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    if peak:
        out.update({f"perf/mfu_{k}": v / world_size / (peak * 1e12) for k, v in per_gpu.items()})
    return out
