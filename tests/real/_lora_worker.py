"""The spawned worker of tests/real/test_lora.py (module level: spawned processes import it by name)."""

from __future__ import annotations

import torch


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def lora_run_outcome(rank, world_size, ckpt, base, lora, seqs, seed):
    """What a two-step LoRA run left in its final checkpoint `ckpt`, against its HF base `base` at TP=1:

    - the checkpoint's log-probs of `seqs` (the Megatron model with its adapters, as the trainer scores: float32,
      the fused output layer), to compare with peft's;
    - that training changed the adapters and nothing of the base: the checkpoint's base parameters bit-equal to
      the HF base's, and its A and B unequal to the adapters the run started from (the same LoRAConfig and seed on
      the same base: roles.load_role_model builds them so);
    - the bytes `megaopd plan` counts, measured on the model the run starts from: every parameter (the frozen base
      plus the adapters), DDP's gradient buffers (grad_reduce_in_fp32: adapters only) and Adam's state after one
      optimizer step (torch's Adam makes it at the first step), wrapped as the trainer wraps it
      (trainer/optim.py; megatron's plain optimizer: its distributed one needs CUDA).
    """
    from megaopd import ops
    from megaopd.batching.micro_batches import ScoringMicroBatch
    from megaopd.models.config import LoRAConfig, StudentConfig
    from megaopd.models.lora import adapter_parameters, adapters
    from megaopd.ops.head import DEFAULT_CHUNK_TOKENS
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.scoring.passes import score_sequences
    from megaopd.scoring.runner import PipelineRunner
    from megaopd.trainer.config import OptimizerConfig
    from megaopd.trainer.optim import build_optimizer, wrap_for_training
    from megaopd.trainer.roles import load_role_model

    torch.set_num_threads(1)
    pgs = initialize_actor_layout(Layout(tp=1))
    lora = LoRAConfig(**lora)
    role = load_role_model(StudentConfig(path=ckpt, tp=1, lora=lora), pgs, trainable=False)  # adapters rebuilt
    trained, vocab = role.model, role.hf.vocab_size
    runner = PipelineRunner(trained, pgs, vocab, logits_chunk_tokens=DEFAULT_CHUNK_TOKENS)
    with torch.no_grad():
        logprobs = score_sequences(runner, seqs)

    start = load_role_model(StudentConfig(path=base, tp=1, lora=lora), pgs, trainable=True, seed=seed).model
    now, then = dict(trained.named_parameters()), dict(start.named_parameters())
    assert now.keys() == then.keys(), sorted(now.keys() ^ then.keys())[:4]
    adapter_ids = {id(p) for p in adapter_parameters(trained)}
    base_names = [n for n, p in now.items() if id(p) not in adapter_ids]
    base_changed = [n for n in base_names if not torch.equal(now[n], then[n])]
    moved = {"lora_A": 0, "lora_B": 0}
    count = 0
    for (_, a), (_, b) in zip(adapters(trained), adapters(start), strict=True):
        count += 1
        moved["lora_A"] += int(not torch.equal(a.lora_A, b.lora_A))
        moved["lora_B"] += int(not torch.equal(a.lora_B, b.lora_B))
    del trained, runner, now

    # The bytes of the run's start: the model as trainer._load_models wraps it, one optimizer step.
    weights = _bytes(start.parameters())
    ddp = wrap_for_training(start, pgs, use_distributed_optimizer=False)
    optimizer, _ = build_optimizer(ddp, OptimizerConfig(lr=1e-4), max_steps=2)
    gradients = _bytes(b.grad_data for b in ddp.buffers + ddp.expert_parallel_buffers)
    ids = torch.tensor([seqs[0]])

    def step_fn(mb, shard, _partner):
        lp = ops.vocab_parallel_logprobs(shard[:, :-1], mb.tokens_BS[:, 1:], pgs.tp)
        return -lp.sum() / lp.numel(), None

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    PipelineRunner(ddp, pgs, vocab).run([ScoringMicroBatch(ids)], step_fn, forward_only=False)
    ok, _, _ = optimizer.step()
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]  # megatron's wrappers
    state = [t for o in inner for s in o.state.values() for t in s.values() if torch.is_tensor(t)]
    return dict(
        logprobs=logprobs,
        base_params=len(base_names),
        base_changed=base_changed,
        adapters=count,
        moved=moved,
        stepped=bool(ok),
        measured=dict(
            weights=weights,
            adapter_params=sum(p.numel() for p in adapter_parameters(start)),
            gradients=gradients,
            adam=_bytes(state),
            adam_tensors=len(state),
        ),
    )
