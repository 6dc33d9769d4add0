"""Multi-turn trajectories through the record, the micro-batches and the losses: environment tokens are
scored with the rest of the trajectory but get exactly zero gradient and zero weight in every loss term and
every metric. Proof by perturbation: two batches that differ only at environment positions (their token
ids, the logits there, every score there) give bit-identical losses and metrics, the same gradient at the
student's positions, and exactly 0 gradient at the environment's."""

import torch

from megaopd.batching.micro_batches import MiniBatch, assemble_micro_batches, assemble_packed_micro_batches
from megaopd.batching.settings import Packing
from megaopd.losses import build_loss
from megaopd.metrics.config import MetricsConfig
from megaopd.rollout.protocol import Sample, TrajectoryStats
from megaopd.rollout.records import TokenScores, build_rollout_batch
from megaopd.trainer.step_metrics import rollout_metrics

V, K, PAD = 16, 4, 0
# Two trajectories: prompt, student turn, environment turn, student turn (the second cut short).
MASKS = [[1, 1, 1, 0, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1]]
PROMPTS = [[3, 4, 5], [6, 7]]
LOSS = {
    "terms": [
        {"name": "opd"},
        {"name": "ref_kl", "weight": 0.1},
        {"name": "lsm", "weight": 0.5, "config": {"k": K}, "label": "lsm_teacher"},
        {"name": "lsm", "weight": 0.5, "config": {"k": 2, "support": "student_topk"}, "label": "lsm_student"},
        {"name": "grpo", "weight": 0.3},
    ]
}


def _samples(env_seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    e = torch.Generator().manual_seed(env_seed)  # what differs between the variants: environment tokens
    out = []
    for p, m in zip(PROMPTS, MASKS):
        ids = [
            int(torch.randint(1, V, (1,), generator=g)) if on else int(torch.randint(1, V, (1,), generator=e))
            for on in m
        ]
        lps = [-float(torch.rand(1, generator=g)) if on else 0.0 for on in m]
        out.append(Sample(p, ids, lps, "stop", output_mask=m, trajectory=TrajectoryStats(2, 1, 0)))
    return out


def _scored(env_seed: int):
    """The record with actor/teacher scores: shared at the student's positions, env_seed's noise elsewhere."""
    batch = build_rollout_batch(_samples(env_seed), PAD, samples_per_prompt=1)
    B, T = batch.loss_mask_BT.shape
    g, e = torch.Generator().manual_seed(1), torch.Generator().manual_seed(env_seed)
    on = batch.loss_mask_BT.bool()

    def field(*shape, ids=False):
        mk = (
            (lambda gen: torch.randint(0, V, (B, T, *shape), generator=gen, dtype=torch.int32))
            if ids
            else (lambda gen: -3 * torch.rand(B, T, *shape, generator=gen))
        )
        a, b = mk(g), mk(e)
        return torch.where(on.reshape(B, T, *[1] * len(shape)), a, b)

    batch.actor = TokenScores(field(), topk_ids_BTK=field(K, ids=True), topk_logprobs_BTK=field(K))
    batch.teacher = TokenScores(
        field(), topk_ids_BTK=field(K, ids=True), topk_logprobs_BTK=field(K), at_ids_logprobs_BTK=field(2)
    )
    batch.rewards_B = torch.tensor([1.0, 0.0])
    batch.texts = ["a", "b"]
    return batch


def _run(env_seed: int, packed: bool):
    batch = _scored(env_seed)
    needs = build_loss("weighted_sum", LOSS).needs
    mini = MiniBatch(batch, batch.loss_mask_BT, None, torch.arange(batch.size), None)
    micro = (
        assemble_packed_micro_batches(mini, 0, 1, needs, Packing(max_tokens=64, pad_id=PAD))
        if packed
        else assemble_micro_batches(mini, 0, 1, needs, 2, PAD)
    )
    loss_fn = build_loss("weighted_sum", LOSS)
    results = []
    for i, mb in enumerate(micro):
        R, S = mb.tokens_BS.shape
        g, e = torch.Generator().manual_seed(10 + i), torch.Generator().manual_seed(env_seed)
        on_S = torch.nn.functional.pad(mb.loss_mask_BT, (0, 1)).bool()[..., None]  # position t: logits at t
        logits = torch.where(on_S, torch.randn(R, S, V, generator=g), 5 * torch.randn(R, S, V, generator=e))
        ref = torch.where(on_S, torch.randn(R, S, V, generator=g), 5 * torch.randn(R, S, V, generator=e))
        logits.requires_grad_(True)
        result = loss_fn(mb.loss_inputs(logits, ref, None, 1.0, needs))
        loss, metrics = result.total, result.metrics
        loss.backward()
        results.append((loss.detach(), {k: v.detach() for k, v in metrics.items()}, logits.grad, on_S))
    return batch, results


def test_build_rollout_batch_masks_environment_turns():
    batch = build_rollout_batch(_samples(5), PAD, 1)
    for b, (p, m) in enumerate(zip(PROMPTS, MASKS)):
        assert batch.loss_mask_BT[b, len(p) - 1 : len(p) - 1 + len(m)].tolist() == [float(x) for x in m]
        assert (
            batch.loss_mask_BT[b, : len(p) - 1].sum() == 0 and batch.loss_mask_BT[b, len(p) - 1 + len(m) :].sum() == 0
        )
        env = batch.loss_mask_BT[b] == 0
        assert batch.engine_logprobs_BT[b][env].eq(0).all()
    assert batch.response_lens_B.tolist() == [8, 6] and batch.student_lens_B.tolist() == [5, 4]
    assert [t.tool_calls for t in batch.trajectories] == [1, 1]


def test_environment_tokens_get_zero_gradient_and_zero_weight_in_every_loss_term():
    for packed in (False, True):
        _, a = _run(env_seed=5, packed=packed)
        _, b = _run(env_seed=6, packed=packed)
        for (la, ma, ga, on), (lb, mb_, gb, _) in zip(a, b):
            assert torch.equal(la, lb), packed
            assert ma.keys() == mb_.keys() and all(torch.equal(ma[k], mb_[k]) for k in ma), packed
            off = ~on.expand_as(ga)
            assert ga[off].eq(0).all() and gb[off].eq(0).all()  # environment (and prompt) positions: no gradient
            assert torch.equal(ga[~off], gb[~off]) and ga[~off].abs().sum() > 0


def test_environment_tokens_have_zero_weight_in_the_rollout_metrics():
    ma = rollout_metrics(_scored(5), MetricsConfig(overlap_k=2)).log
    mb = rollout_metrics(_scored(6), MetricsConfig(overlap_k=2)).log
    assert ma == mb
    assert ma["rollout/response_length_mean"] == 4.5  # the student's tokens: (5 + 4) / 2
    assert ma["traj/env_token_share"] == 5 / 14 and ma["traj/tool_calls_mean"] == 1.0
    assert ma["traj/turns_mean"] == 2.0
