"""Spawned workers of the multi-turn trainer tests (module level, importable by spawned processes)."""

from __future__ import annotations


class AlwaysAnswers:
    """An environment that answers every turn with a tool result: trajectories run to rollout.max_turns
    (the tiny student never calls the calculator on its own)."""

    tools: list = []

    def reset(self, example) -> None:
        pass

    def step(self, text: str):
        from megaopd.envs import StepResult

        return StepResult(done=False, observations=["42"], tool_calls=1, tool_errors=int("Error" in text))


def multi_turn_rollout(rank, world_size, cfg):
    """One multi-turn rollout through the real trainer (embedded engine, in-job teacher, the actor's scoring
    pass) and one training step on it; returns the whole batch's tokens, masks, actor and teacher log-probs
    and the step's metrics (rank 0)."""
    import megaopd.rollout.trajectories as TR
    from megaopd.trainer.step_metrics import rollout_metrics
    from megaopd.trainer.trainer import Trainer
    from tests.trainer._workers import whole_batch

    TR.build_environment = lambda env_cfg: AlwaysAnswers()
    trainer = Trainer(cfg)
    examples = trainer.loader.next_batch()
    batch = trainer._rollout(examples)
    metrics = rollout_metrics(batch, cfg.metrics, contributes=trainer.owners.sends).log  # collective
    sends = trainer.owners.sends
    actor = whole_batch(batch.actor.logprobs_BT, batch.actor.rows, batch.size, sends)
    teacher = whole_batch(batch.teacher.logprobs_BT, batch.teacher.rows, batch.size, sends)
    metrics.update(trainer._train(batch, None).log())  # TrainMetrics: the loss and optimizer metrics
    if trainer.run_log is not None:
        trainer.run_log.close()
    if rank != 0:
        return None
    return {
        "tokens": batch.tokens_BS,
        "mask": batch.loss_mask_BT,
        "prompt_lens": batch.prompt_lens_B,
        "response_lens": batch.response_lens_B,
        "engine": batch.engine_logprobs_BT,
        "actor": actor,
        "teacher": teacher,
        "metrics": metrics,
        "turns": [t.turns for t in batch.trajectories],
    }


def run_presets_always_answering(rank, world_size, cfgs):
    """tests.trainer._workers.run_presets with every environment an AlwaysAnswers: multi-turn trajectories
    from the tiny student, which never calls a tool on its own."""
    import megaopd.rollout.trajectories as TR
    from tests.trainer._workers import run_presets

    TR.build_environment = lambda env_cfg: AlwaysAnswers()
    return run_presets(rank, world_size, cfgs)
