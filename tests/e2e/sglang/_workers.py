"""Spawned trainer workers of tests/e2e/sglang/test_trainer.py (module level: imported by name)."""

from __future__ import annotations


def train_capturing_teacher(rank, world_size, cfgs):
    """Runs each config to its last step in this process group; per config, on rank 0: every step's rollout
    (token ids, loss mask) with the teacher's log q of every row, and the last logged metrics."""
    import megaopd.trainer.trainer as trainer_module
    from megaopd.trainer.trainer import Trainer
    from tests.trainer._workers import whole_batch

    original = trainer_module.Trainer._rollout
    out = []
    for cfg in cfgs:
        steps = []

        def capturing(self, examples, times, *args, steps=steps):
            batch = original(self, examples, times, *args)
            teacher = whole_batch(batch.teacher.logprobs_BT, batch.teacher.rows, batch.size, self.owners.sends)
            steps.append({"tokens": batch.tokens_BS.clone(), "mask": batch.loss_mask_BT.clone(), "teacher": teacher})
            return batch

        trainer_module.Trainer._rollout = capturing
        try:
            trainer = Trainer(cfg)
            trainer.train()
        finally:
            trainer_module.Trainer._rollout = original
        if trainer.run_log is not None:
            trainer.run_log.close()
        out.append({"steps": steps, "metrics": dict(trainer._last_metrics)} if rank == 0 else None)
    return out
