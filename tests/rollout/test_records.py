import torch

from megaopd.rollout.protocol import Sample
from megaopd.rollout.records import build_rollout_batch


def test_rollout_batch_alignment_and_padding():
    samples = [
        Sample([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], "stop"),
        Sample([5, 6], [10], [-0.5], "length"),
        Sample([1, 2, 3], [4, 4], [-1.0, -2.0], "stop"),
        Sample([1, 2, 3], [], [], "length"),
    ]
    b = build_rollout_batch(samples, pad_id=0, samples_per_prompt=2)
    assert b.tokens_BS.tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, 0, 0], [1, 2, 3, 4, 4], [1, 2, 3, 0, 0]]
    # position t predicts token t+1, so the mask marks positions whose target is a response token
    assert b.loss_mask_BT.tolist() == [[0, 1, 1, 1], [0, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0]]
    masked_targets = b.targets_BT[b.loss_mask_BT.bool()].tolist()
    assert masked_targets == [7, 8, 9, 10, 4, 4]
    assert torch.allclose(
        b.engine_logprobs_BT[b.loss_mask_BT.bool()], torch.tensor([-0.1, -0.2, -0.3, -0.5, -1.0, -2.0])
    )
    assert b.truncated_B.tolist() == [False, True, False, True]
    assert b.group_ids_B.tolist() == [0, 0, 1, 1]
    assert b.finish_reasons == ["stop", "length", "stop", "length"] and b.size == 4


def test_score_field_table_names_token_scores_fields():
    """SCORE_FIELDS is every per-token field of TokenScores (take, the routing and the merge loop over it)."""
    import dataclasses

    from megaopd.rollout.records import SCORE_FIELDS, TokenScores

    assert [f.name for f in SCORE_FIELDS] == [f.name for f in dataclasses.fields(TokenScores) if f.name != "rows"]
    s = TokenScores(
        torch.arange(6.0).reshape(3, 2), topk_ids_BTK=torch.zeros(3, 2, 4, dtype=torch.int32), rows=[2, 5, 7]
    )
    t = s.take([7, 2])
    assert t.rows == [7, 2] and t.logprobs_BT.tolist() == [[4.0, 5.0], [0.0, 1.0]] and t.entropy_BT is None
    assert t.topk_ids_BTK.shape == (2, 2, 4) and [f.name for f in t.present()] == ["logprobs_BT", "topk_ids_BTK"]
