"""Rollout scores land on the ranks that train each row, and only there: each rank of a
4-process gloo job holds exactly its actor replica's rows, equal to HF float64 on them, for the actor in its
own layout (no data moves) and teachers in other layouts (one all_to_all of real positions): actor TP=2 DP=2
against teacher TP=1 DP=4, TP=2 DP=2 and TP=2 PP=2 DP=1; padded and packed."""

import pytest

from megaopd.parallel.launch import spawn
from tests.scoring import _owner_workers as w
from tests.trainer.tiny_models import make_tiny_pair

TOL = 1e-5  # float32 Megatron vs float64 HF on a tiny random model (seen: <= 6e-7)


@pytest.mark.slow
@pytest.mark.parametrize("pack", [False, True])
def test_each_rank_holds_its_owned_rows_scored_exactly(tmp_path, pack):
    student, teacher = make_tiny_pair(str(tmp_path / "models"))
    layouts = [(1, 1), (2, 1), (2, 2)]
    results = spawn(w.owned_scores, 4, args=(student, teacher, 2, layouts, pack), timeout=900)
    B = len(w.LENGTHS)
    for r in results:
        mine = [b for b in range(B) if w.OWNER[b] == r["dp_rank"]]
        assert r["mine"] == mine
        for name in ["actor"] + [f"teacher_tp{tp}_pp{pp}" for tp, pp in layouts]:
            e = r[name]
            assert e["rows"] == mine, name  # only the owned rows, in increasing order
            assert all(shape[0] == len(mine) for shape in e["shapes"].values()), (name, e["shapes"])
            assert e["ids_dtype"] == "torch.int32"
            assert e["logprobs"] < TOL and e["entropy"] < TOL and e["topk_logprobs"] < TOL, (name, e)
            assert e["topk_ids_equal"] and e["zeros_past_length"], (name, e)
            if name != "actor":
                assert e["at_ids"] < TOL, (name, e)
        assert r["everyone"]["rows"] == list(range(B)) and r["everyone"]["logprobs"] < TOL
