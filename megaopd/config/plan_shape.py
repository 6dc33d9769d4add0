"""The largest micro-batch a job's own rows make, as `megaopd plan` counts it: the rows of one step at their
budgets (data.max_prompt_len + rollout.max_new_tokens, or the trajectory budget; + data.max_golden_len for
golden rows), shared over data parallelism and cut into micro-batches by the trainer's own functions
(megaopd.batching: balanced_partition, pack_by_budget, round_up). A job whose step holds 200 tokens is
planned at 200 tokens, not at trainer.max_tokens_per_micro_batch.

    shapes = job_shapes(rows, student_dp, [(teacher_dp, teacher_tokens)], tp_multiple)
    shapes.train, shapes.score      # MicroBatchShape: rows x tokens per row, the longest sequence in it

The lengths are budgets: real rows are shorter, so this is the largest micro-batch the job can make.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megaopd.batching.packing import pack_by_budget, round_up
from megaopd.batching.shares import balanced_partition


@dataclass(frozen=True)
class StepRows:
    """One step's rows at their budgets, and how the trainer cuts them (from the config)."""

    rollout_rows: int
    """On-policy rows per step (prompts x samples; 0 when the loss trains on golden rows alone)."""
    rollout_tokens: int
    """Tokens of the longest on-policy row (MegaOPDConfig.rollout_row_tokens)."""
    golden_rows: int
    """Golden rows per step (one per prompt for losses that train on them, else 0)."""
    golden_tokens: int
    """Tokens of the longest golden row (MegaOPDConfig.golden_row_tokens)."""
    group: int
    """Rows packed together as one unit (a GRPO group, samples_per_prompt, for losses with rewards; else 1)."""
    mini_batches: int
    """trainer.mini_batches_per_step: each optimizer step trains 1/mini_batches of the rows."""
    max_tokens: int
    """trainer.max_tokens_per_micro_batch when packing; 0: padded rows."""
    micro_batch_size: int
    """trainer.micro_batch_size (padded rows)."""


@dataclass(frozen=True)
class MicroBatchShape:
    """One forward's tokens: `rows` rows of `tokens` each (packed: one row)."""

    rows: int
    tokens: int
    """Tokens per row (packed: the whole packed row)."""
    longest: int
    """The longest sequence in it (a packed row attends within each sequence only)."""
    packed: bool

    def describe(self) -> str:
        return f"{self.tokens} tokens packed" if self.packed else f"{self.rows} x {self.tokens} tokens"


@dataclass(frozen=True)
class JobShapes:
    train: MicroBatchShape
    """The largest training micro-batch on any data-parallel rank (on-policy and golden rows)."""
    score: MicroBatchShape
    """The largest scoring micro-batch (on-policy rows) of the scoring models' passes."""


def _largest_packed(units: list[list[int]], dp: int, budget: int) -> int:
    """Tokens of the largest packed micro-batch: units balanced over dp (tokens and attention cost), each
    share packed first-fit-decreasing into the budget, as the trainer does."""
    largest = 0
    for share in balanced_partition(units, dp):
        sizes = [sum(units[i]) for i in share]
        for b in pack_by_budget(sizes, budget) if sizes else []:
            largest = max(largest, sum(sizes[i] for i in b))
    return largest


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def train_shape(r: StepRows, dp: int, multiple: int = 1) -> MicroBatchShape:
    """The largest training micro-batch of one mini-batch on one data-parallel rank."""
    rollout_rows = r.rollout_rows // r.mini_batches
    golden_rows = r.golden_rows // r.mini_batches
    longest = max(r.rollout_tokens if rollout_rows else 0, r.golden_tokens if golden_rows else 0, 1)
    if r.max_tokens:
        units = [[r.rollout_tokens] * r.group for _ in range(rollout_rows // r.group)]
        units += [[r.rollout_tokens]] * (rollout_rows % r.group)
        units += [[r.golden_tokens]] * golden_rows
        tokens = max(_largest_packed(units, dp, r.max_tokens), 2)
        return MicroBatchShape(1, round_up(tokens, multiple), longest, True)
    # Padded (micro_batches.assemble_micro_batches): micro_batch_size on-policy rows (padded to that many)
    # plus this micro-batch's even share of the golden rows, all as wide as the widest.
    local, g_local = _ceil(rollout_rows, dp), _ceil(golden_rows, dp)
    if rollout_rows:
        rows = r.micro_batch_size + _ceil(g_local, max(1, _ceil(local, r.micro_batch_size)))
    else:
        rows = r.micro_batch_size
    return MicroBatchShape(rows, longest, longest, False)


def score_shape(r: StepRows, dp: int, multiple: int = 1) -> MicroBatchShape:
    """The largest micro-batch of a scoring pass over the step's on-policy rows by a model of `dp`
    data-parallel replicas (each scores its share: balanced by tokens, or contiguous rows)."""
    if not r.rollout_rows:
        return MicroBatchShape(1, 2, 2, bool(r.max_tokens))
    if r.max_tokens:
        tokens = _largest_packed([[r.rollout_tokens]] * r.rollout_rows, dp, r.max_tokens)
        return MicroBatchShape(1, round_up(tokens, multiple), r.rollout_tokens, True)
    return MicroBatchShape(min(r.micro_batch_size, r.rollout_rows), r.rollout_tokens, r.rollout_tokens, False)


def job_shapes(r: StepRows, student_dp: int, scorers: list[tuple[int, int]], multiple: int = 1) -> JobShapes:
    """The training micro-batch at the student's data parallelism, and the larger scoring micro-batch of
    the scoring models: the actor at student_dp over the rollout rows, each in-job teacher, given as
    (its data parallelism, the tokens of its longest row), over rows of its own length (a teacher with a
    context of its own reads a longer prefix: MegaOPDConfig.teacher_row_tokens)."""
    scores = [score_shape(r, student_dp, multiple)]
    scores += [score_shape(replace(r, rollout_tokens=tokens), dp, multiple) for dp, tokens in scorers]
    return JobShapes(train_shape(r, student_dp, multiple), max(scores, key=lambda s: s.rows * s.tokens))
