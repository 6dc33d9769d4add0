"""Spawned worker of tests/scoring/test_fused_output_layer.py: the fused output layer (PipelineRunner
logits_chunk_tokens > 0) against the model's own output layer, through the runner, DDP and the losses."""

from __future__ import annotations

import torch

VOCAB, CHUNK, TOPK = 250, 5, 4


def compare(rank, world_size, tied):
    """At TP=world_size: Stable-OPD (reference in lockstep) gradients of every parameter (DDP main_grad) and a
    scoring pass (log-probs, entropy, top-k, log-probs at given ids; padded and packed), chunked vs whole.
    Returns {what: max relative difference}."""
    from megaopd.batching.micro_batches import MicroBatch, ScoringBatches, StepCounts
    from megaopd.losses import build_loss, loss_input
    from megaopd.models.builder import build_gpt_model
    from megaopd.models.hf_config import read_hf_config
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.scoring import PipelineRunner
    from megaopd.scoring.passes import ScoreRequest, score_tokens
    from megaopd.trainer.optim import wrap_for_training

    torch.manual_seed(0)
    hf = read_hf_config(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": tied,
        }
    )
    pgs = initialize_actor_layout(Layout(world_size, 1), seed=1)
    actor = build_gpt_model(hf, Layout(tp=world_size), pgs).train()
    reference = build_gpt_model(hf, Layout(tp=world_size), pgs).eval().requires_grad_(False)
    ddp = wrap_for_training(actor, pgs, False)
    loss_fn = build_loss("stable_opd")
    g = torch.Generator().manual_seed(3)
    B, S = 2, 12
    T = S - 1
    tokens = torch.randint(3, VOCAB, (B, S), generator=g)
    mask = (torch.arange(T) >= 4).float().expand(B, T)
    mb = MicroBatch(
        tokens_BS=tokens,
        loss_mask_BT=mask,
        golden_mask_BT=1 - mask,
        counts=StepCounts(float(mask.sum()), B, float((1 - mask).sum()), B),
        inputs={
            loss_input("old_logprobs_BT"): -torch.rand(B, T, generator=g),
            loss_input("teacher_logprobs_BT"): -torch.rand(B, T, generator=g),
        },
    )

    def step_fn(m, logits, partner):
        loss = loss_fn(m.loss_inputs(logits, partner, pgs.tp, 0.8, loss_fn.needs)).total
        return loss, loss.detach()

    at_ids = torch.randint(0, VOCAB, (B, T, 3), generator=g)
    out = {}
    for chunk in (0, CHUNK):
        ddp.zero_grad_buffer()
        loss = PipelineRunner(ddp, pgs, VOCAB, partner=reference, logits_chunk_tokens=chunk).run(
            [mb], step_fn, forward_only=False
        )[0]
        grads = {n: p.main_grad.clone() for n, p in actor.named_parameters()}
        runner = PipelineRunner(actor, pgs, VOCAB, logits_chunk_tokens=chunk)
        request = ScoreRequest(0.8, topk=TOPK, entropy=True)
        padded = score_tokens(runner, tokens, ScoringBatches(2), request, at_ids_BTK=at_ids)
        packed = score_tokens(runner, tokens, ScoringBatches(2, 2 * S, torch.tensor([S, S - 3])), request)
        out[chunk] = (loss, grads, padded, packed)

    def rel(a, b):
        return float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))

    (loss0, grads0, padded0, packed0), (loss1, grads1, padded1, packed1) = out[0], out[CHUNK]
    diffs = {"loss": rel(loss0, loss1)}
    diffs.update({f"grad {n}": rel(grads0[n], grads1[n]) for n in grads0})
    for name, a, b in (("padded", padded0, padded1), ("packed", packed0, packed1)):
        for field in ("logprobs_BT", "entropy_BT", "topk_logprobs_BTK", "at_ids_logprobs_BTK"):
            if getattr(a, field) is not None:
                diffs[f"{name} {field}"] = rel(getattr(a, field), getattr(b, field))
        diffs[f"{name} topk ids differ"] = float((a.topk_ids_BTK != b.topk_ids_BTK).float().mean())
    return diffs
