"""Spawned workers of tests/trainer/test_lora_student.py (module level: spawned processes import them by name)."""

from __future__ import annotations

import torch


def lora_optimizer_step(rank, world_size, hf_dir, ids, tp):
    """The student as the trainer builds it (roles.load_role_model, student.lora on) at TP=tp, wrapped for training
    with the job's optimizer (megatron's plain Adam: its distributed optimizer needs CUDA tensors), one step of
    -mean(log-probs): what the optimizer holds, what changed."""
    from megaopd import ops
    from megaopd.batching.micro_batches import ScoringMicroBatch
    from megaopd.models.config import LoRAConfig, StudentConfig
    from megaopd.models.lora import adapter_parameters
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.scoring.runner import PipelineRunner
    from megaopd.trainer.config import OptimizerConfig
    from megaopd.trainer.optim import build_optimizer, wrap_for_training
    from megaopd.trainer.roles import load_role_model

    pgs = initialize_actor_layout(Layout(tp=tp))
    section = StudentConfig(path=hf_dir, tp=tp, lora=LoRAConfig(enabled=True, rank=4, alpha=8.0, targets=["all"]))
    role = load_role_model(section, pgs, trainable=True, seed=1)
    model = role.model
    adapters = {id(p) for p in adapter_parameters(model)}
    ddp = wrap_for_training(model, pgs, use_distributed_optimizer=False)
    optimizer, _ = build_optimizer(ddp, OptimizerConfig(lr=1e-2), max_steps=4)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    runner = PipelineRunner(ddp, pgs, role.hf.vocab_size)

    def step_fn(mb, shard, _partner):
        lp = ops.vocab_parallel_logprobs(shard[:, :-1], mb.tokens_BS[:, 1:], pgs.tp)
        return -lp.sum() / lp.numel(), None

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    runner.run([ScoringMicroBatch(ids)], step_fn, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    changed = sorted(n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n]))
    return dict(
        ok=bool(ok),
        grad_norm=float(grad_norm),
        held_are_adapters=all(id(p) in adapters for p in held),
        held_numel=sum(p.numel() for p in held),
        adapter_numel=sum(p.numel() for p in adapter_parameters(model)),
        model_numel=sum(p.numel() for p in model.parameters()),
        changed=changed,
    )


def lora_checkpoint_and_export(rank, world_size, hf_dir, out, tp):
    """A LoRA student at TP=tp with seeded adapters: the final export's two folders (trainer.export_hf -> hf/,
    trainer.export_adapter -> hf_adapter/ naming hf_dir as the base), and a checkpoint of it (base_model in its
    metadata, as the trainer's Checkpointer writes) loaded back as student.path by roles.load_role_model: with
    student.lora matching (adapters rebuilt before the load: equal), and refused with it off."""
    import os

    from megaopd.models.checkpoint import read_checkpoint_meta, save_model_checkpoint
    from megaopd.models.config import LoRAConfig, StudentConfig
    from megaopd.models.lora import adapter_parameters, adapters
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.trainer.roles import load_role_model
    from megaopd.trainer.trainer import export_adapter, export_hf

    pgs = initialize_actor_layout(Layout(tp))
    lora = LoRAConfig(enabled=True, rank=4, alpha=8.0, targets=["all"])
    actor = load_role_model(StudentConfig(path=hf_dir, tp=tp, lora=lora), pgs, trainable=True, seed=2)
    gen = torch.Generator().manual_seed(7 + pgs.tp.rank())
    for _, a in adapters(actor.model):
        with torch.no_grad():
            a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=gen) * 0.1)
            if a.kind == "row":  # replicated B: the same on every TP rank
                torch.distributed.broadcast(
                    a.lora_B.data, src=torch.distributed.get_global_rank(pgs.tp, 0), group=pgs.tp
                )
    export_hf(actor, os.path.join(out, "hf"))
    export_adapter(actor, os.path.join(out, "hf_adapter"), os.path.abspath(hf_dir))
    ckpt = os.path.join(out, "ckpt")
    save_model_checkpoint(actor.model, ckpt, actor.hf, pgs, hf_side_dir=hf_dir, extra_meta={"base_model": hf_dir})
    back = load_role_model(StudentConfig(path=ckpt, tp=tp, lora=lora), pgs, trainable=True, seed=9)
    same = all(torch.equal(p, q) for p, q in zip(adapter_parameters(actor.model), adapter_parameters(back.model)))
    try:
        load_role_model(StudentConfig(path=ckpt, tp=tp), pgs, trainable=True)
        refusal = ""
    except ValueError as e:
        refusal = str(e)
    return dict(same=same, refusal=refusal, base_model=read_checkpoint_meta(ckpt).get("base_model"))
