import pytest

from megaopd.parallel.launch import spawn
from tests.parallel import _workers


@pytest.mark.slow
def test_teacher_tp2_beside_actor_tp1_matches_single_layout():
    diffs = spawn(_workers.actor_tp1_teacher_tp2, world_size=2)
    assert max(diffs) < 1e-5, diffs


@pytest.mark.slow
def test_teacher_reads_no_global_parallel_state():
    diffs = spawn(_workers.teacher_reads_no_global_state, world_size=2)
    assert max(diffs) < 1e-5, diffs


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from megaopd.models.presets import make_hf_model

    path = str(tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe")
    make_hf_model("tiny-qwen3-moe", path)
    return path


@pytest.mark.slow
def test_moe_teacher_ep2_beside_dense_actor_layout(tiny_moe):
    diffs = spawn(_workers.teacher_moe_ep2_beside_dense_actor, world_size=2, args=(tiny_moe,))
    assert max(diffs) < 1e-5, diffs


@pytest.mark.slow
def test_router_aux_loss_on_for_student_off_for_teacher(tiny_moe):
    for r in spawn(_workers.moe_router_aux_loss, world_size=2, args=(tiny_moe,)):
        assert r["coeff"] == (0.001, 0.0)
        assert r["router_grad_diff"] > 0  # the aux loss adds to the router's gradient
        assert r["experts_have_grad"]


def test_layout_ep_must_divide_dp():
    from megaopd.parallel.groups import Layout

    assert Layout(tp=2, pp=1, ep=2).dp(4) == 2
    with pytest.raises(ValueError, match="ep=2 does not divide the data-parallel size 1"):
        Layout(tp=2, pp=2, ep=2).dp(4)
