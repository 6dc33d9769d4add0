"""The actor's DDP wrapper, Megatron optimizer (Adam) and learning-rate schedule.

Gradient reduction: every loss already divides its token sum by the WHOLE step's count (all
micro-batches, all data-parallel ranks), so gradients must be SUMMED over DP, never averaged, and the
pipeline schedule must not divide by the number of micro-batches. megatron's
`calculate_per_token_loss=True` gives exactly that (DDP scaling 1, no schedule division); our
finalize hook then passes no token count, so megatron does not rescale either.

DDP and the optimizer take their groups from megatron's global parallel_state, which holds exactly the
actor's layout (megaopd.parallel.groups.initialize_actor_layout): they also need the expert and
distributed-optimizer groups that only parallel_state builds.

Expert parallelism (a MoE student at EP > 1): megatron marks routed-expert parameters `allreduce=False`;
DDP puts them in buffers of their own reduced over the expert data-parallel group (parallel_state's
expt_dp = dp / ep ranks, the same ranks as the actor's pgs.expt_dp), since each EP rank's experts already
received the gradients of every token routed to them from the whole EP group. The per-token loss makes
both scaling factors 1 (a sum), as for the dense parameters. get_megatron_optimizer gives the expert
parameters an optimizer of their own over the same groups, and the gradient norm spans both
(tests/trainer/test_qwen3.py: the same gradient and norm at EP=1 and EP=2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megaopd.trainer.config import OptimizerConfig


def wrap_for_training(model: torch.nn.Module, pgs, use_distributed_optimizer: bool) -> DistributedDataParallel:
    config = model.config
    _check_expert_groups(pgs)
    config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer
        ),
        module=model,
    )
    # The schedule passes the module it ran, which may be the actor with its reference in lockstep:
    # the gradients to finalize are always the actor's.
    config.finalize_model_grads_func = lambda models, num_tokens=None, pg_collection=None, force_all_reduce=False: (
        finalize_model_grads([ddp], None, pg_collection=pgs, force_all_reduce=force_all_reduce)
    )
    return ddp


def _check_expert_groups(pgs) -> None:
    """DDP reduces expert gradients over parallel_state's expert data-parallel group: it must be the actor's
    (a model built at another EP than initialize_actor_layout set would silently skip or double them)."""
    from megatron.core import parallel_state

    expt_dp = getattr(pgs, "expt_dp", None)
    if expt_dp is None:
        return
    global_ranks = dist.get_process_group_ranks(parallel_state.get_expert_data_parallel_group())
    if dist.get_process_group_ranks(expt_dp) != global_ranks:
        raise ValueError(
            f"the actor's expert data-parallel group {dist.get_process_group_ranks(expt_dp)} is not "
            f"megatron's {global_ranks}: build the actor's groups with "
            "megaopd.parallel.groups.initialize_actor_layout(Layout(tp, pp, ep)) at the student's ep"
        )


def build_optimizer(ddp: DistributedDataParallel, cfg: OptimizerConfig, max_steps: int):
    """Megatron Adam(W) over the actor and its warmup + decay schedule (steps = optimizer steps)."""
    mcfg = ddp.config
    opt_cfg = MegatronOptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=mcfg.bf16,
        fp16=mcfg.fp16,
        params_dtype=mcfg.params_dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_cfg, [ddp], use_gloo_process_groups=False)
    return optimizer, ConfigSchedule(optimizer, cfg, max_steps)


class ConfigSchedule(OptimizerParamScheduler):
    """Megatron's warmup + decay schedule, as the job's config says it, also on resume.

    Warmup: optimizer step k (from 0) trains at lr * (k + 1) / warmup_steps, so step 0 trains (megatron's own
    ramp would start at init_lr = 0, so `warmup_steps: 1` would make the first step a no-op): the ramp
    is megatron's from init_lr = lr / W over W - 1 steps, and decay starts from lr at step W - 1.

    Resume: the checkpoint gives the position (num_steps); the config gives everything else. Megatron's
    scheduler would keep the checkpoint's max_lr / decay steps (use_checkpoint_opt_param_scheduler), and the
    optimizer's load_state_dict restores the saved param groups (their max_lr, min_lr, betas, eps), so a
    resume with optimizer.lr=1e-2 would keep training at the old 5e-4. Restored after the optimizer
    (trainer/checkpoint.py loads the optimizer first, then the Stateful components), load_state_dict writes the
    config's values back into the param groups and then takes the saved step count.
    """

    def __init__(self, optimizer, cfg: OptimizerConfig, max_steps: int):
        self.cfg = cfg
        warmup = cfg.warmup_steps
        decay_steps = max(max_steps, warmup + 1)
        super().__init__(
            optimizer,
            init_lr=cfg.lr / warmup if warmup else cfg.lr,
            max_lr=cfg.lr,
            min_lr=cfg.min_lr,
            lr_warmup_steps=max(warmup - 1, 0),
            lr_decay_steps=decay_steps,
            lr_decay_style=cfg.decay_style,
            start_wd=cfg.weight_decay,
            end_wd=cfg.weight_decay,
            wd_incr_steps=decay_steps,
            wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
        )

    def current_lr(self) -> float:
        """The lr the next optimizer step uses (what train/lr logs: read before step())."""
        return float(self.optimizer.param_groups[0]["lr"])

    def load_state_dict(self, state_dict: dict) -> None:
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group.update(max_lr=cfg.lr, min_lr=cfg.min_lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
        super().load_state_dict(state_dict)


class RouterAuxLoss:
    """The MoE router's load-balancing loss on megaopd's gradient convention.

    Megatron's router, under calculate_per_token_loss, adds coeff * aux_loss * n (n: the micro-batch's
    routed tokens) and relies on finalize_model_grads dividing every gradient by the step's token count.
    megaopd's losses divide by their own global counts and its finalize divides nothing, so the aux
    gradient would come out n times too large. Per mini-batch this sets the coefficient to
    coeff / N (N: routed tokens of the mini-batch over every DP rank): the aux term is then the
    token-weighted mean of the micro-batches' aux losses times coeff, as megatron means it. Dense models:
    nothing to do."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core.utils import get_attr_wrapped_model

        self.config = get_attr_wrapped_model(model, "config")
        self.base = getattr(self.config, "moe_aux_loss_coeff", 0.0) or 0.0

    def scale_for(self, micro_batches, dp_group) -> None:
        """Collective over dp_group when the router has an aux loss."""
        if not self.base:
            return
        from megaopd.parallel.dist import device

        n = torch.tensor([float(sum(mb.tokens_BS.numel() for mb in micro_batches))], device=device())
        dist.all_reduce(n, group=dp_group)
        self.config.moe_aux_loss_coeff = self.base / max(float(n.item()), 1.0)
