"""Micro-batch assembly, a pure function tested without Megatron: global denominators, DP shares, golden
rows spread over the micro-batches, GRPO group ids, and equal shapes."""

import torch

from megaopd.batching.micro_batches import MiniBatch, assemble_micro_batches
from megaopd.data import GoldenBatch
from megaopd.losses import LOSS_INPUTS, LossNeeds, loss_input
from megaopd.rollout.records import RolloutBatch, TokenScores

# The declared inputs these tests look at (each declared once, by its LossNeeds field: losses/needs.py).
OLD_LOGPROBS, TEACHER_LOGPROBS, TEACHER_SPANS = map(
    loss_input, ("old_logprobs_BT", "teacher_logprobs_BT", "teacher_spans_BT")
)
REWARDS, GROUP_IDS = map(loss_input, ("rewards_S", "group_ids_S"))

PAD = 0


def _rollout(B=6, S=7):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 50, (B, S), generator=g)
    mask = torch.zeros(B, S - 1)
    for b in range(B):
        mask[b, 2 : 2 + b % 4 + 1] = 1  # 1..4 response tokens
    lp = -torch.rand(B, S - 1, generator=g)
    return RolloutBatch(
        tokens_BS=tokens,
        loss_mask_BT=mask,
        engine_logprobs_BT=lp.clone(),
        prompt_lens_B=torch.full((B,), 3),
        response_lens_B=mask.sum(-1).long(),
        finish_reasons=["stop"] * B,
        group_ids_B=torch.arange(B) // 2,
        actor=TokenScores(logprobs_BT=lp),
        teacher=TokenScores(logprobs_BT=lp - 1),
        rewards_B=torch.arange(B, dtype=torch.float32),
    )


def _golden(P=3, L=9):
    ids = torch.arange(1, P * L + 1).reshape(P, L)
    mask = torch.zeros(P, L)
    mask[:, 4:] = 1
    return GoldenBatch(ids, mask, torch.ones(P, L, dtype=torch.long), torch.full((P,), L))


def test_denominators_are_global_and_dp_shares_partition_the_rows():
    rollout, golden = _rollout(), _golden()
    needs = LossNeeds(old_logprobs=True, teacher_logprobs=True, golden=True)
    rows, grows = torch.arange(6), torch.arange(3)
    seen, golden_seen = [], []
    for dp_rank in range(2):
        micro = assemble_micro_batches(
            MiniBatch(rollout, rollout.loss_mask_BT, golden, rows, grows), dp_rank, 2, needs, 2, PAD
        )
        for mb in micro:
            assert mb.counts.global_num_tokens == float(rollout.loss_mask_BT.sum())
            assert mb.counts.global_num_seqs == 6.0
            assert mb.counts.global_num_golden_tokens == float(golden.loss_mask_BT[:, 1:].sum())
            assert mb.tokens_BS.shape == micro[0].tokens_BS.shape  # pipeline buffers are fixed-size
            on_policy = mb.loss_mask_BT.sum(-1) > 0
            for r in range(mb.tokens_BS.shape[0]):
                if on_policy[r]:
                    seen.append(mb.tokens_BS[r, :7].tolist())  # padded to the golden rows' length
                if mb.golden_mask_BT[r].sum() > 0:
                    golden_seen.append(mb.tokens_BS[r, :9].tolist())
                    assert mb.loss_mask_BT[r].sum() == 0  # a golden row never counts in the on-policy loss
        # Each micro-batch: 2 on-policy rows then its share of this rank's golden rows.
        assert all(mb.tokens_BS.shape[0] == 3 for mb in micro)
    assert sorted(seen) == sorted(rollout.tokens_BS.tolist())  # every row trained once over the DP ranks
    assert sorted(golden_seen) == sorted(golden.input_ids_BT.tolist())


def test_per_token_fields_follow_their_rows():
    rollout = _rollout()
    needs = LossNeeds(old_logprobs=True, teacher_logprobs=True)
    mini = MiniBatch(rollout, rollout.loss_mask_BT, None, torch.arange(2, 6), None)
    micro = assemble_micro_batches(mini, 0, 1, needs, 3, PAD)
    assert len(micro) == 2 and micro[1].tokens_BS[1:].eq(PAD).all()  # row padding to micro_batch_size
    assert torch.equal(micro[0].inputs[OLD_LOGPROBS], rollout.actor.logprobs_BT[2:5])
    assert torch.equal(micro[1].inputs[TEACHER_LOGPROBS][0], rollout.teacher.logprobs_BT[5])
    assert set(micro[0].inputs) == {OLD_LOGPROBS, TEACHER_LOGPROBS}  # only what the loss needs
    assert micro[0].counts.global_num_tokens == float(rollout.loss_mask_BT[2:6].sum())


def test_grpo_group_ids_keep_padding_rows_out_of_real_groups():
    rollout = _rollout()
    needs = LossNeeds(old_logprobs=True, rewards=True)
    mini = MiniBatch(rollout, rollout.loss_mask_BT, None, torch.arange(6), None)
    micro = assemble_micro_batches(mini, 0, 1, needs, 4, PAD)
    assert micro[0].inputs[GROUP_IDS].tolist() == [0, 0, 1, 1]
    assert micro[1].inputs[GROUP_IDS].tolist()[:2] == [2, 2]
    assert all(g >= rollout.size for g in micro[1].inputs[GROUP_IDS].tolist()[2:])  # padding: groups of their own
    assert micro[1].inputs[REWARDS].tolist() == [4.0, 5.0, 0.0, 0.0]


def test_sft_only_micro_batches_are_golden_rows():
    golden = _golden(P=5)
    mini = MiniBatch(None, None, golden, None, torch.arange(5))
    micro = assemble_micro_batches(mini, 0, 1, LossNeeds(golden=True), 2, PAD)
    assert len(micro) == 3 and all(mb.tokens_BS.shape == (2, 9) for mb in micro)
    assert micro[0].counts.global_num_tokens is None
    assert micro[0].counts.global_num_golden_seqs == 5.0
    assert torch.equal(micro[2].tokens_BS[0], golden.input_ids_BT[4])


def test_loss_inputs_shift_by_one_and_route_the_partner():
    rollout = _rollout()
    needs = LossNeeds(old_logprobs=True, teacher_logprobs=True, reference=True)
    mini = MiniBatch(rollout, rollout.loss_mask_BT, None, torch.arange(2), None)
    mb = assemble_micro_batches(mini, 0, 1, needs, 2, PAD)[0]
    logits = torch.randn(2, 7, 11)
    ref = torch.randn(2, 7, 11)
    inputs = mb.to(torch.device("cpu")).loss_inputs(logits, ref, None, 1.0, needs)
    assert torch.equal(inputs.token_ids_BT, mb.tokens_BS[:, 1:])
    assert torch.equal(inputs.ref_logits_BTv, ref[:, :-1]) and inputs.teacher_logits_BTv is None
    assert inputs.global_num_tokens == mb.counts.global_num_tokens


def test_packed_rows_are_padded_to_the_sequence_parallel_multiple():
    from megaopd.batching.micro_batches import assemble_packed_micro_batches
    from megaopd.batching.settings import Packing

    rollout, golden = _rollout(), _golden()
    needs = LossNeeds(old_logprobs=True, teacher_logprobs=True, golden=True)
    for uniform in (False, True):
        mini = MiniBatch(rollout, rollout.loss_mask_BT, golden, torch.arange(6), torch.arange(3))
        micro = assemble_packed_micro_batches(
            mini, 0, 1, needs, Packing(max_tokens=20, pad_id=PAD, uniform=uniform, multiple=4)
        )
        assert all(mb.tokens_BS.shape[1] % 4 == 0 for mb in micro)
        assert sum(float(mb.loss_mask_BT.sum()) for mb in micro) == float(rollout.loss_mask_BT.sum())


def _trained_rows(micro) -> list[int]:
    """On-policy rows of a rank's micro-batches, read back from their old log-probs (row b's are all b + 1)."""
    out = set()
    for mb in micro:
        values = mb.inputs[OLD_LOGPROBS][mb.loss_mask_BT.bool()]
        out.update(int(v) - 1 for v in values.unique().tolist())
    return sorted(out)


def test_row_owners_is_the_partition_the_micro_batches_take():
    """Each DP rank, given scores of ONLY the rows row_owners gives it, builds its micro-batches of every
    mini-batch (no row it lacks is asked for) and they train exactly those rows: padded and packed, with
    golden units in the balance, GRPO groups kept whole, 1 or 2 mini-batches, DP 1..3."""
    import dataclasses

    from megaopd.batching.micro_batches import step_micro_batches
    from megaopd.batching.settings import BatchingSettings
    from megaopd.batching.shares import mini_batch_rows, row_owners

    B, S = 12, 9
    base = _rollout(B, S)
    base.response_lens_B = base.loss_mask_BT.sum(-1).long() + torch.tensor(
        [0, 3, 1, 0, 2, 0, 1, 0, 0, 2, 1, 0]
    )  # uneven lengths
    row_id_BT = (torch.arange(B, dtype=torch.float32) + 1).unsqueeze(1).expand(B, S - 1).contiguous()
    golden = _golden(P=6, L=5)
    for pack in (False, True):
        for rewards in (False, True):
            for M in (1, 2):
                settings = BatchingSettings(
                    prompts_per_step=6, mini_batches=M, micro_batch_size=2, pad_id=PAD, max_tokens=16 if pack else None
                )
                needs = LossNeeds(old_logprobs=True, golden=True, rewards=rewards)
                for dp in (1, 2, 3):
                    owner = row_owners(base, golden, dp, needs, settings)
                    assert owner == row_owners(base, golden, dp, needs, settings)  # deterministic
                    for d in range(dp):
                        mine = [b for b in range(B) if owner[b] == d]
                        rollout = dataclasses.replace(base, actor=TokenScores(row_id_BT[mine], rows=mine))
                        trained = []
                        for j in range(M):
                            rows, grows = mini_batch_rows(B, 6, M, j, True)
                            micro = step_micro_batches(
                                MiniBatch(rollout, rollout.loss_mask_BT, golden, rows, grows), d, dp, needs, settings
                            )
                            got = _trained_rows(micro)
                            assert set(got) <= set(rows.tolist())
                            trained += got
                        assert trained == mine, (pack, rewards, M, dp, d)
                    if rewards and pack:  # a GRPO group (rows 2i, 2i+1) has one owner
                        assert all(owner[2 * i] == owner[2 * i + 1] for i in range(B // 2))


def test_a_row_not_held_is_one_clear_error():
    import pytest

    scores = TokenScores(torch.zeros(2, 3), rows=[1, 4])
    assert scores.index([4, 1]).tolist() == [1, 0]
    with pytest.raises(KeyError, match="rows \\[2\\] are not held on this rank"):
        scores.index([1, 2])


def test_the_field_table_names_loss_inputs_and_carries_their_dtypes():
    """Every declared input fills a LossInputs field of its name, and micro-batches carry it in its dtype, padded
    and packed alike (what a loss needs is declared once: its LossNeeds field)."""
    import dataclasses

    from megaopd.batching.micro_batches import assemble_packed_micro_batches
    from megaopd.batching.settings import Packing
    from megaopd.losses import LossInputs

    assert {f.name for f in LOSS_INPUTS} <= {f.name for f in dataclasses.fields(LossInputs)}
    K = 2
    rollout = _rollout()
    scores = TokenScores(
        rollout.actor.logprobs_BT,
        topk_ids_BTK=torch.zeros(6, 6, 3, dtype=torch.int32),
        topk_logprobs_BTK=torch.zeros(6, 6, 3),
        at_ids_logprobs_BTK=torch.zeros(6, 6, K),
        spans_BT=torch.zeros(6, 6, dtype=torch.int32),
    )
    rollout = dataclasses.replace(rollout, actor=scores, teacher=scores)
    needs = LossNeeds(
        old_logprobs=True, teacher_logprobs=True, teacher_topk=K, student_topk=K, rewards=True, engine_logprobs=True
    )
    mini = MiniBatch(rollout, rollout.loss_mask_BT, None, torch.arange(6), None)
    padded, packed = (
        assemble_micro_batches(mini, 0, 1, needs, 4, PAD),
        assemble_packed_micro_batches(mini, 0, 1, needs, Packing(max_tokens=20, pad_id=PAD)),
    )
    for micro in (padded, packed):
        assert set(micro[0].inputs) == set(LOSS_INPUTS)
        for f, x in micro[0].inputs.items():
            assert x.dtype == f.dtype, f.name
            assert x.shape[-1] == K or f.per_sequence or f.name.endswith("_BT"), f.name  # top-k cut to the need
    # An optional field its holder lacks (a same-tokenizer teacher's spans) is not carried: the loss reads None.
    rollout = dataclasses.replace(rollout, teacher=dataclasses.replace(scores, spans_BT=None))
    mini = MiniBatch(rollout, rollout.loss_mask_BT, None, torch.arange(6), None)
    for micro in (
        assemble_micro_batches(mini, 0, 1, needs, 4, PAD),
        assemble_packed_micro_batches(mini, 0, 1, needs, Packing(max_tokens=20, pad_id=PAD)),
    ):
        assert set(micro[0].inputs) == set(LOSS_INPUTS) - {TEACHER_SPANS}


def test_teacher_spans_travel_with_the_teacher_scores_and_pad_with_minus_one():
    """A cross-tokenizer teacher's spans (TokenScores.spans_BT) follow its rows through take / map and into
    padded and packed micro-batches as LossInputs.teacher_spans_BT (long), -1 at padding and golden rows."""
    import dataclasses

    from megaopd.batching.micro_batches import assemble_packed_micro_batches
    from megaopd.batching.settings import Packing

    rollout = _rollout()
    spans = (torch.arange(6)[:, None] * 10 + torch.arange(6)[None, :]).to(torch.int32)  # row b, position t: 10b + t
    rollout = dataclasses.replace(rollout, teacher=dataclasses.replace(rollout.teacher, spans_BT=spans))
    assert torch.equal(rollout.teacher.take([4, 1]).spans_BT, spans[[4, 1]])
    needs = LossNeeds(old_logprobs=True, teacher_logprobs=True)
    mini = MiniBatch(rollout, rollout.loss_mask_BT, _golden(P=2, L=5), torch.arange(6), torch.arange(2))
    padded = assemble_micro_batches(mini, 0, 1, needs, 4, PAD)
    packed = assemble_packed_micro_batches(mini, 0, 1, needs, Packing(max_tokens=20, pad_id=PAD))
    seen = set()
    for mb in padded + packed:
        x = mb.inputs[TEACHER_SPANS]
        on = mb.loss_mask_BT.bool()
        assert x.dtype == torch.int32
        assert bool((x[mb.golden_mask_BT.bool()] == -1).all())
        seen |= set(x[on].tolist())
        logits = torch.zeros(*mb.tokens_BS.shape, 8)
        inputs = mb.loss_inputs(logits, None, None, 1.0, needs)
        assert inputs.teacher_spans_BT.dtype == torch.long
    assert seen == set(spans[rollout.loss_mask_BT.bool()].tolist())  # every response position's span, once
