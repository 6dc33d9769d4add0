"""The step's logged metrics beyond the loss's own: training dynamics of the rollouts
(docs/algorithms.md section 2), the engine/actor log-prob gap, and the reduction of the micro-batches'
loss metrics over the data-parallel ranks.
"""
from __future__ import annotations

import torch.distributed as dist

from megaopd.config.sections import MetricsConfig
from megaopd.metrics import advantage_split, repetitive_token_mask, response_metrics, rollout_dynamics, topk_overlap
from megaopd.rollout.batch import RolloutBatch
from megaopd.scoring.teachers import teacher_metrics


def rollout_metrics(batch: RolloutBatch, mcfg: MetricsConfig) -> dict[str, float]:
    """Truncation, repetition, dynamics, the repetitive/regular advantage split, top-k overlap, and the
    engine/actor log-prob gap (the first sign of a broken weight sync) of one step's rollouts."""
    actor, teacher = batch.actor, batch.teacher
    mask = batch.loss_mask_BT  # every generated token (repetitive n-grams need them all)
    out = response_metrics(batch.texts, batch.finish_reasons, mcfg.repetition)
    adv_BT = (teacher.logprobs_BT - actor.logprobs_BT) * mask if teacher is not None else None
    out.update(rollout_dynamics(batch.response_lens_B, mask, actor.logprobs_BT,
                                teacher.logprobs_BT if teacher is not None else None, adv_BT))
    if adv_BT is not None:
        rep_BT = repetitive_token_mask(batch.targets_BT, mask, mcfg.repetition.ngram)
        split = advantage_split(adv_BT, rep_BT, mask)
        out.update({"adv/regular_mean": split["adv/regular_mean"],
                    "adv/repetitive_mean": split["adv/repetitive_mean"],
                    "adv/repetitive_token_share": split["adv/repetitive_share"]})
        if mcfg.overlap_k:
            k = mcfg.overlap_k
            out.update(topk_overlap(actor.topk_ids_BTK[..., :k], actor.topk_logprobs_BTK[..., :k],
                                    teacher.topk_ids_BTK[..., :k], mask, actor.entropy_BT, teacher.entropy_BT))
    if teacher is not None and len(batch.teacher_rows) > 1:  # several teachers: their metrics apart too
        out.update(teacher_metrics(batch, batch.teacher_rows))
    gap = (batch.engine_logprobs_BT - actor.logprobs_BT).abs()[mask.bool()]
    out["sync/logprob_gap_mean"] = float(gap.mean()) if gap.numel() else 0.0
    out["sync/logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
    out["rollout/reward_mean"] = float(batch.rewards_B.mean())
    return out


def reduce_loss_metrics(results: list[dict], is_reporter: bool) -> dict[str, float]:
    """Loss metrics of the step on rank 0: per-micro-batch loss shares are summed (each already divides
    by the step's global count), other metrics averaged over micro-batches and DP ranks. Term losses
    are renamed "<term>/loss" -> "loss/<term>". Reporters: the last pipeline stage's TP rank 0 of each
    DP replica (collective over the world)."""
    local = [{k: float(v) for k, v in m.items()} for m in results] if is_reporter else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = [m for part in gathered for m in part]
    if not merged:
        return {}
    out = {}
    for key in merged[0]:
        values = [m[key] for m in merged if key in m]
        is_share = key == "loss/total" or key.endswith("/loss")
        name = f"loss/{key[:-len('/loss')]}" if key.endswith("/loss") else key
        out[name] = sum(values) if is_share else sum(values) / len(values)
    return out


def sample_rows(batch: RolloutBatch, tokenizer, n: int) -> list[dict]:
    """The first n responses of the step as RUN/samples/step_N.jsonl rows."""
    return [{"prompt": tokenizer.decode(batch.tokens_BS[b, :int(batch.prompt_lens_B[b])].tolist()),
             "response": batch.texts[b], "finish_reason": batch.finish_reasons[b], "reward": float(batch.rewards_B[b])}
            for b in range(min(n, batch.size))]
