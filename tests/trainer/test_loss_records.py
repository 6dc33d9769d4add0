"""The trainer's side of the loss's typed record (losses/registry.py LossResult): the step's reduction sums the
micro-batches' total and terms and averages their metrics, the log names are made once (StepLoss.log), and the
non-finite check reads the terms and the total, naming the term over the total. One gloo rank."""

import math

import pytest
import torch

from megaopd.losses import LossResult
from megaopd.trainer.nonfinite import NonFinite, describe
from megaopd.trainer.step_metrics import reduce_loss_metrics

pytestmark = pytest.mark.usefixtures("one_gloo_rank")  # the code under test calls torch.distributed


def _result(opd: float, sft: float, kl: float) -> LossResult:
    t = torch.tensor
    return LossResult(t(opd + 0.1 * sft), {"opd": t(opd), "sft": t(sft)}, {"opd/kl": t(kl)})


def test_shares_are_summed_metrics_averaged_and_named_once():
    step = reduce_loss_metrics([_result(0.25, 0.5, 1.0), _result(0.125, 0.25, 3.0)], is_reporter=True)
    assert step.total == pytest.approx(0.375 + 0.075) and step.terms == {"opd": 0.375, "sft": 0.75}
    assert step.metrics == {"opd/kl": 2.0}
    assert step.log() == {"loss/total": step.total, "loss/opd": 0.375, "loss/sft": 0.75, "opd/kl": 2.0}
    assert reduce_loss_metrics([], is_reporter=True) is None


def test_a_non_finite_term_is_named_before_the_total():
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    good, bad = _result(0.25, 0.5, 1.0), _result(0.25, math.inf, 1.0)
    assert not NonFinite.check([good], model)
    flagged = NonFinite.check([good, bad], model)
    assert flagged.loss and not flagged.grad
    assert describe(flagged, [good, bad], [3], 0) == "non-finite loss sft/loss=inf in the micro-batches of rows [3]"
    overflow = LossResult(torch.tensor(math.inf), {"opd": torch.tensor(1.0)}, {})  # finite terms, infinite sum
    assert "loss/total=inf" in describe(NonFinite.check([overflow], model), [overflow], [5], 0)
