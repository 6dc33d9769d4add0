"""The output layer fused with the loss (megaopd.ops.head): logits made a chunk of tokens at a time, the
backward recomputing each chunk. Values and gradients (hidden states and the weight shard) of the Stable-OPD
step's fused log-probs + reference KL + entropy, the LSM support KL, the GKD JSD and the scoring passes'
top-k, against the float64 full-vocabulary formula, at TP=1 (in process) and TP=2 (gloo workers), and
chunked == materialized on the same shard."""

import pytest
import torch

from megaopd.ops.head import LogitsHead, tokenwise
from megaopd.parallel.launch import spawn
from tests.ops import _head_cases as cases

# The ops compute in float32 (their results are float32) even on float64 logits: float32 rounding of O(1)
# numbers, scaled by each tensor's size.
RTOL = 2e-5


def _assert_matches(got: dict, want: dict, world_size: int, rank: int | None = None):
    for name, value in want.items():
        if name == "grad_weight" and rank is not None:
            v = cases.V_PADDED // world_size
            value = value[rank * v : (rank + 1) * v]
        g = got[name]
        if name == "topk_ids":
            assert torch.equal(g.long(), value), name
            continue
        assert g.shape == value.shape, (name, g.shape, value.shape)
        atol = RTOL * max(1.0, float(value.abs().max()))
        torch.testing.assert_close(g.double(), value.double(), atol=atol, rtol=RTOL, msg=name)


def test_tp1_chunked_matches_float64_formula():
    _assert_matches(cases.run(0, 1, None), cases.reference(), 1)


def test_tp1_chunked_equals_materialized():
    chunked, whole = cases.run(0, 1, None), cases.run(0, 1, None, chunk_tokens=None)
    _assert_matches(chunked, {k: v for k, v in whole.items()}, 1)


def test_padding_columns_get_no_gradient_and_no_mass():
    out = cases.run(0, 1, None)
    assert torch.count_nonzero(out["grad_weight"][cases.V_REAL :]) == 0
    assert (out["topk_ids"] < cases.V_REAL).all()


def test_no_grad_path_and_a_plain_tensor_are_fn_itself():
    inp = cases.inputs()
    head = LogitsHead(inp["hidden"], inp["weight"], cases.V_REAL, None, chunk_tokens=5)
    with torch.no_grad():
        lse = tokenwise(lambda z: torch.logsumexp(z, -1), head)
    torch.testing.assert_close(lse, torch.logsumexp(head.materialize(), -1))
    x = torch.randn(3, 4)
    assert tokenwise(lambda z: z * 2, x).equal(x * 2)
    with pytest.raises(ValueError, match="leading shape"):
        tokenwise(lambda z, ids: z, head, torch.zeros(3, 3))


@pytest.mark.slow
def test_tp2_matches_float64_formula_and_tp1():
    results = [cases.load(p) for p in spawn(cases.worker, world_size=2, timeout=300)]
    want = cases.reference()
    for rank, r in enumerate(results):
        _assert_matches(r["chunked"], want, 2, rank)
        _assert_matches(r["whole"], want, 2, rank)
