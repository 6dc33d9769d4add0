"""A non-finite loss term or gradient stops the step with one error naming the term, the step and the rows
(a teacher reading past its vocabulary gives loss 1.6e29 and grad norm 1e308: no run should end 0 on that),
or, with trainer.skip_nonfinite, skips that optimizer update.

    bad = NonFinite.check(step_results, ddp)        # collective: one all-reduce of two flags
    if bad: raise bad.error(step, describe(...))     # the details are gathered only on this rare path

Every rank decides on the same flags, so every rank stops (or skips) together: the rank holding the loss
(the last pipeline stage) and the one holding a bad gradient shard need not be the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaopd.losses import LossResult
from megaopd.parallel.dist import device


@dataclass(frozen=True)
class NonFinite:
    """What was non-finite in one optimizer step, over the whole job."""

    loss: bool
    grad: bool

    def __bool__(self) -> bool:
        return self.loss or self.grad

    @staticmethod
    def check(results: list[LossResult], ddp) -> "NonFinite":
        """Collective over the world: this rank's micro-batch losses (last stage) and gradient buffers."""
        loss = any(not math.isfinite(float(v)) for r in results for v in [r.total, *r.terms.values()])
        flags = torch.tensor([float(loss), float(not _grads_finite(ddp))], device=device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return NonFinite(bool(flags[0]), bool(flags[1]))


def _grads_finite(ddp) -> bool:
    """One reduction per gradient buffer (megatron DDP keeps the grads in contiguous buffers); a sum is
    non-finite when any element is (or when finite grads overflow it, which are no better)."""
    buffers = []
    for name in ("buffers", "expert_parallel_buffers"):
        held = getattr(ddp, name, None)
        if isinstance(held, list):  # megatron's DDP: a list (over nn.Module.buffers, a method elsewhere)
            buffers += held
    if not buffers:  # not megatron's DDP: the parameters' own grads
        grads = [p.grad for p in ddp.parameters() if p.grad is not None]
        return all(bool(torch.isfinite(g.sum())) for g in grads)
    return all(bool(torch.isfinite(b.grad_data.float().sum())) for b in buffers)


def describe(bad: NonFinite, results: list[LossResult], rows: list, dp_rank: int) -> str:
    """Collective (all ranks, only after a NonFinite): the terms and rows of every rank, in one line. rows:
    the step's rows this rank's replica trained in the mini-batch (ints, or "golden N" for SFT rows)."""
    terms = {f"{label}/loss={float(v)}" for r in results for label, v in r.terms.items() if not math.isfinite(float(v))}
    # The terms name the cause; the total alone only when every term is finite (a weight that overflows them).
    totals = {f"loss/total={float(r.total)}" for r in results if not math.isfinite(float(r.total))}
    mine = {"terms": sorted(terms), "totals": sorted(totals), "rows": rows if terms or totals else [], "dp": dp_rank}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    named = sorted({t for g in gathered for t in g["terms"]}) or sorted({t for g in gathered for t in g["totals"]})
    bad_rows = list(dict.fromkeys(r for g in gathered for r in g["rows"]))  # data-parallel rank order
    shown = ", ".join(map(str, bad_rows[:16])) + (f", ... ({len(bad_rows)} rows)" if len(bad_rows) > 16 else "")
    parts = []
    if bad.loss:
        parts.append(f"non-finite loss {', '.join(named)} in the micro-batches of rows [{shown}]")
    if bad.grad:
        parts.append("non-finite gradients" + ("" if bad.loss else " (the loss terms were finite)"))
    return " and ".join(parts)
