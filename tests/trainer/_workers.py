"""Spawned workers of the trainer tests (module level, importable by spawned processes)."""

from __future__ import annotations

import torch


def one_step_gradients(rank, world_size, cfg):
    """Runs one training step of `cfg` and returns the actor's gradient as full HF-named tensors
    (gathered over TP/EP/PP) together with the step's loss (rank 0)."""
    out = one_step_gradients_and_metrics(rank, world_size, cfg)
    return (
        None
        if out is None
        else {"grads": out["grads"], "grad_norm": out["grad_norm"], "loss": out["metrics"].get("loss/total")}
    )


def run_presets(rank, world_size, cfgs):
    """Runs each config to completion in this one process group (a Trainer per config, in turn);
    returns, per config, the last logged metrics (rank 0)."""
    from megaopd.trainer.trainer import Trainer

    out = []
    for cfg in cfgs:
        trainer = Trainer(cfg)
        trainer.train()
        if trainer.run_log is not None:
            trainer.run_log.close()
        out.append(dict(trainer._last_metrics) if rank == 0 else None)
    return out


def two_teachers_rollout(rank, world_size, cfg):
    """One rollout of a two-teacher config; then every teacher scores the WHOLE batch alone. Returns the
    batch's routed teacher scores, the rows of each teacher and each teacher's scores alone (rank 0)."""
    from megaopd.batching.micro_batches import ScoringBatches
    from megaopd.scoring.passes import ScoreRequest, score_tokens
    from megaopd.scoring.teachers import InJobTeacher
    from megaopd.trainer.trainer import Trainer

    trainer = Trainer(cfg)
    examples = trainer.loader.next_batch()
    from megaopd.parallel.dist import rank0_computes

    batch = trainer._rollout(examples)
    tokens_BS = rank0_computes(lambda: batch.tokens_BS)  # every row on every rank (the trainer sends each its own)
    alone = {}
    for name, t in trainer.models.teachers.teachers.items():
        if isinstance(t, InJobTeacher):
            alone[name] = score_tokens(
                t.runner, tokens_BS, ScoringBatches(cfg.trainer.micro_batch_size), ScoreRequest(1.0)
            ).logprobs_BT
        elif rank == 0:
            alone[name] = t.score(batch.tokens_BS, batch.prompt_lens_B, batch.response_lens_B).logprobs_BT
    if trainer.run_log is not None:
        trainer.run_log.close()
    from megaopd.trainer.step_metrics import rollout_metrics

    metrics = rollout_metrics(batch, cfg.metrics, contributes=trainer.owners.sends).log  # collective
    teacher = whole_batch(batch.teacher.logprobs_BT, batch.teacher.rows, batch.size, trainer.owners.sends)
    if rank != 0:
        return None
    return {
        "teacher": teacher,
        "rows": batch.teacher_rows,
        "alone": alone,
        "mask": batch.loss_mask_BT,
        "sources": [ex.source for ex in examples],
        "metrics": metrics,
    }


def whole_batch(x_BT, rows, num_rows, contributes):
    """The whole batch's [B, ...] from each rank's owned rows (collective; tests only: training never
    assembles it)."""
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (rows, x_BT) if contributes else None)
    out = torch.zeros((num_rows, *x_BT.shape[1:]), dtype=x_BT.dtype)
    for part in parts:
        if part is not None:
            out[torch.tensor(part[0], dtype=torch.long)] = part[1]
    return out


def one_step_everything(rank, world_size, cfg):
    """one_step_gradients, plus every metric of the step and the rollout's per-token scores (actor log pi_old,
    teacher log q) under the loss mask (rank 0)."""

    import megaopd.trainer.trainer as trainer_module

    captured = {}
    original_rollout = trainer_module.Trainer._rollout

    def capturing_rollout(self, examples, golden=None):
        batch = original_rollout(self, examples, golden)
        mask = batch.loss_mask_BT.bool()
        sends = self.owners.sends
        captured["actor_logprobs"] = torch.where(
            mask, whole_batch(batch.actor.logprobs_BT, batch.actor.rows, batch.size, sends), 0.0
        )
        if batch.teacher is not None:
            captured["teacher_logprobs"] = torch.where(
                mask, whole_batch(batch.teacher.logprobs_BT, batch.teacher.rows, batch.size, sends), 0.0
            )
        return batch

    trainer_module.Trainer._rollout = capturing_rollout
    try:
        out = one_step_gradients_and_metrics(rank, world_size, cfg)
    finally:
        trainer_module.Trainer._rollout = original_rollout
    if out is not None:
        out.update(captured)
    return out


def one_step_gradients_and_metrics(rank, world_size, cfg):
    """One training step: the actor's gradient as full HF-named tensors (gathered over TP/EP/PP), the
    grad norm and every metric of the step (rank 0)."""
    from megaopd.models.gather import gather_hf_weights
    from megaopd.sync.weight_sync import expert_group
    from megaopd.trainer.trainer import Trainer

    trainer = Trainer(cfg)
    captured = {}
    original_step = trainer.optimizer.step

    def capturing_step():
        grads = {}
        for name, p in trainer.actor.model.named_parameters():
            g = getattr(p, "main_grad", None)
            grads[name] = (g if g is not None else p.grad).detach().clone().float()
        captured["grads"] = {
            n: t.clone()
            for n, t in gather_hf_weights(
                grads,
                trainer.actor.hf,
                trainer.actor_pgs.tp,
                trainer.actor_pgs.pp,
                ep_group=expert_group(trainer.actor_pgs),
            )
        }
        result = original_step()
        captured["grad_norm"] = result[1]
        return result

    trainer.optimizer.step = capturing_step
    metrics = trainer.train_step().log()  # the step's metrics row
    if trainer.run_log is not None:
        trainer.run_log.close()
    if rank != 0:
        return None
    return {
        "grads": captured["grads"],
        "grad_norm": captured["grad_norm"],
        "metrics": {k: float(v) for k, v in metrics.items() if not k.startswith("time")},
    }
