"""RolloutBatch and TokenScores: the records that carry a step's responses from the engines to the loss.

Shape legend: B sequences, S = padded length of prompt + response, T = S - 1 predicted positions
(position t holds the logits of tokens[:, t] and predicts tokens[:, t + 1]), K top-K size.
Sequences are right-padded, so causal attention never lets padding reach a real position.

    batch = build_rollout_batch(samples, pad_id, samples_per_prompt)   # engines -> record (every rank)
    batch.actor = score_tokens(...)      # megaopd.scoring fills the per-token scores ...
    batch.teacher = teachers.score(...)
    batch.rewards_B = ...                # ... and the trainer the verifiable rewards

Golden (SFT) rows travel beside it in megaopd.data.GoldenBatch; the micro-batches of the scoring passes
and the training step are cut from both by megaopd.batching.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from megaopd.engine.rows import FinishReason
from megaopd.rollout.protocol import Sample, TrajectoryStats


@dataclass
class TokenScores:
    """Per-token outputs of one model (the actor or the teacher) at every position of the rows it holds.

    In training a rank holds only the rows its actor data-parallel replica trains (`rows`, see
    megaopd.batching.owners.RowOwners):
    the leading dimension B of every field is then len(rows), row i of a field being batch row rows[i].
    Log-probs stay float32: the losses' ratios and KLs are differences of log-probs, and bf16/fp16 would
    round them by up to 1e-2 nats (exactness of the loss; the golden tests pin them at 1e-6)."""

    logprobs_BT: torch.Tensor
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]) at the rollout temperature [B, T] (float32)."""
    entropy_BT: torch.Tensor | None = None
    """Entropy of the model's next-token distribution [B, T]; None unless a metric asked for it."""
    topk_ids_BTK: torch.Tensor | None = None
    """The model's top-K token ids, by decreasing probability [B, T, K] (int32: a vocabulary fits, and
    half the bytes of long; ops that index take .long() of it on the device)."""
    topk_logprobs_BTK: torch.Tensor | None = None
    """Full-vocabulary log-probs at topk_ids_BTK [B, T, K]."""
    at_ids_logprobs_BTK: torch.Tensor | None = None
    """Log-probs at caller-given ids per position (the teacher at the student's top-k) [B, T, K]."""
    spans_BT: torch.Tensor | None = None
    """Span index of each position under a cross-tokenizer teacher [B, T] (int32); None = every token is its
    own span. Spans number a response's stretches of text that the student's and the teacher's tokens both
    cover whole (megaopd.data.alignment); -1 where a position has no span (a special token, the prompt,
    padding). logprobs_BT then holds each span's teacher log-prob spread evenly over its student tokens
    (alignment.spread_span_logprobs), and the opd loss sums both sides over spans."""
    rows: list[int] | None = None
    """The batch rows held, in the order of the fields' first dimension (increasing); None = every row of
    the batch, in batch order."""

    def index(self, batch_rows) -> torch.Tensor:
        """Positions in the fields' first dimension of the given batch rows (long); a row this rank does not
        hold is an error that names it."""
        batch_rows = torch.as_tensor(batch_rows, dtype=torch.long).reshape(-1)
        if self.rows is None:
            return batch_rows
        where = {r: i for i, r in enumerate(self.rows)}
        missing = [int(r) for r in batch_rows.tolist() if int(r) not in where]
        if missing:
            raise KeyError(
                f"rows {missing[:8]} are not held on this rank (it holds {len(self.rows)} rows, the ones "
                f"its actor data-parallel replica trains): build micro-batches from the same RowOwners "
                f"the scores were routed with (batching.shares.row_owners)"
            )
        return torch.tensor([where[int(r)] for r in batch_rows.tolist()], dtype=torch.long)

    def topk_support(self, k: int) -> "TokenScores | None":
        """The first k of the top-k ids (the student's support, which LSM asks the teacher to score); None
        when k is 0."""
        if not k:
            return None
        return TokenScores(self.logprobs_BT, rows=self.rows, topk_ids_BTK=self.topk_ids_BTK[..., :k])

    def present(self) -> list["ScoreField"]:
        """The score fields this record holds (SCORE_FIELDS order)."""
        return [f for f in SCORE_FIELDS if getattr(self, f.name) is not None]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], rows: list[int] | None = None) -> "TokenScores":
        """fn of every field held, as a new record (of `rows`, default: the same rows)."""
        return TokenScores(
            **{f.name: fn(getattr(self, f.name)) for f in self.present()}, rows=self.rows if rows is None else rows
        )

    def take(self, batch_rows: list[int]) -> "TokenScores":
        """The scores of the given batch rows only (rows set to them)."""
        i = self.index(batch_rows)
        return self.map(lambda x: x[i], rows=list(batch_rows))


@dataclass(frozen=True)
class ScoreField:
    """One per-token output of a scoring pass as TokenScores holds it: a row of SCORE_FIELDS, the table
    that the passes, the routing of scores to their owners and the teachers' merge loop over."""

    name: str
    """The TokenScores attribute."""
    dtype: torch.dtype
    """float32 (log-probs, entropy) or int32 (ids: a vocabulary fits, half the bytes of long)."""
    trailing: Callable[[int, int], tuple[int, ...]]
    """Its shape past [B, T] given (the pass's top-k, the number of ids it scores at)."""


LOGPROBS = ScoreField("logprobs_BT", torch.float32, lambda topk, at: ())
ENTROPY = ScoreField("entropy_BT", torch.float32, lambda topk, at: ())
TOPK_IDS = ScoreField("topk_ids_BTK", torch.int32, lambda topk, at: (topk,))
TOPK_LOGPROBS = ScoreField("topk_logprobs_BTK", torch.float32, lambda topk, at: (topk,))
AT_IDS_LOGPROBS = ScoreField("at_ids_logprobs_BTK", torch.float32, lambda topk, at: (at,))
# Not a forward pass's output but the alignment's, carried with the teacher's scores wherever they go.
SPANS = ScoreField("spans_BT", torch.int32, lambda topk, at: ())
SCORE_FIELDS: tuple[ScoreField, ...] = (LOGPROBS, ENTROPY, TOPK_IDS, TOPK_LOGPROBS, AT_IDS_LOGPROBS, SPANS)


@dataclass
class RolloutBatch:
    """A step's responses (prompt-major: the n samples of prompt i are rows i*n .. i*n + n - 1)."""

    tokens_BS: torch.Tensor
    """prompt + response ids, right-padded with pad_id [B, S] (long)."""
    loss_mask_BT: torch.Tensor
    """1 where position t predicts a response token (t + 1 in the response) [B, T] (float)."""
    engine_logprobs_BT: torch.Tensor
    """The engine's log-prob of the token that position t predicts; 0 outside loss_mask [B, T]."""
    prompt_lens_B: torch.Tensor
    """Prompt tokens per row [B] (long)."""
    response_lens_B: torch.Tensor
    """Tokens after the prompt per row [B] (long): the generated ones, the stop token included, and in a
    multi-turn trajectory the environment turns between them too (student_lens_B counts the generated ones)."""
    finish_reasons: list[FinishReason]
    """Why each response ended: "stop" (EOS or a stop token), "length" (budget used up), "abort" [B]."""
    group_ids_B: torch.Tensor
    """Index of the prompt each sequence answers (its GRPO group) [B] (long)."""
    texts: list[str] = field(default_factory=list)
    """The decoded responses [B] (repetition metrics, rewards, samples); filled by the trainer on rank 0 (empty
    on the other ranks, which get the metrics made of them)."""
    actor: TokenScores | None = None
    """The actor's forward-only scores before the update: log pi_old (+ its top-k and entropy)."""
    teacher: TokenScores | None = None
    """The teacher's scores: log q (+ top-K, entropy, log-probs at the student's top-k)."""
    rewards_B: torch.Tensor | None = None
    """Verifiable reward per sequence [B] (float32; grpo, metrics)."""
    teacher_rows: dict[str, list[int]] = field(default_factory=dict)
    """Rows scored by each teacher, by name (increasing row order); filled with `teacher` by the trainer."""
    teacher_prefixes: dict[str, list[list[int]]] = field(default_factory=dict)
    """Per teacher that reads a sequence of its own (teacher.context / teacher.tokenizer), each batch row's
    prefix in the teacher's ids [B] (empty for other teachers' rows): the teacher scores that prefix, then the
    row's response (megaopd.scoring.views). Filled with teacher_rows by the trainer, the same on every rank."""
    weight_versions_B: torch.Tensor | None = None
    """The engine's weight version (the trainer step whose weights it held) when each row's first token was
    generated [B] (long); older than the trained weights under rollout.mode one_step_off / async. Filled by
    the trainer's pipeline (megaopd.trainer.rollout_flow)."""
    trajectories: list[TrajectoryStats] | None = None
    """Multi-turn rollouts: each row's turns, tool calls and errors [B]; None for single-turn responses.
    Their environment tokens sit in tokens_BS with loss_mask_BT 0: scored, never trained, never counted."""
    student_lens_B: torch.Tensor | None = None
    """Tokens the student generated per row [B] (long): response_lens_B less any environment tokens (the
    loss mask's row sums, taken when the record is built: every rank has them, held rows or not)."""
    held_B: torch.Tensor | None = None
    """Rows whose per-token fields (tokens_BS, loss_mask_BT, engine_logprobs_BT) this rank holds [B] (bool);
    the others are padding (batching.delivery: a rank receives only the rows it trains or scores). None:
    every row (rank 0, a one-process job)."""

    def __post_init__(self):
        if self.student_lens_B is None:
            self.student_lens_B = self.loss_mask_BT.sum(-1).long()

    @property
    def size(self) -> int:
        return self.tokens_BS.shape[0]

    def check_held(self, rows, what: str) -> None:
        """Raises, naming `what`, when a per-token read would touch rows this rank was not sent."""
        if self.held_B is None:
            return
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        missing = rows[~self.held_B[rows]]
        if missing.numel():
            raise KeyError(
                f"{what}: rows {missing[:8].tolist()} of the rollout were not delivered to this rank (it "
                f"holds {int(self.held_B.sum())} of {self.size}); batching.delivery.row_users must list "
                f"every rank that reads a row"
            )

    @property
    def targets_BT(self) -> torch.Tensor:
        """The token each position predicts [B, T]."""
        return self.tokens_BS[:, 1:]

    @property
    def truncated_B(self) -> torch.Tensor:
        """1 where the response ran out of budget (finish reason "length") [B] (bool)."""
        return torch.tensor([r == "length" for r in self.finish_reasons], dtype=torch.bool)


def build_rollout_batch(samples: list[Sample], pad_id: int, samples_per_prompt: int) -> RolloutBatch:
    """Pads prompt-major samples (n per prompt, as engines return them) into a RolloutBatch."""
    if not samples:
        raise ValueError("no samples to build a batch from: the engines returned nothing")
    B = len(samples)
    S = max(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    tokens_BS = torch.full((B, S), pad_id, dtype=torch.long)
    loss_mask_BT = torch.zeros(B, S - 1)
    engine_logprobs_BT = torch.zeros(B, S - 1)
    for b, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.output_ids)
        tokens_BS[b, :p] = torch.tensor(s.prompt_ids)
        if r == 0:  # an aborted request: the row stays, with nothing to learn from
            continue
        tokens_BS[b, p : p + r] = torch.tensor(s.output_ids)
        # Position t predicts token t + 1: the response tokens p..p+r-1 are predicted at p-1..p+r-2.
        generated = 1.0 if s.output_mask is None else _student_mask(s, b)  # trajectories: environment turns 0
        loss_mask_BT[b, p - 1 : p + r - 1] = generated
        engine_logprobs_BT[b, p - 1 : p + r - 1] = torch.tensor(s.output_logprobs, dtype=torch.float32) * generated
    return RolloutBatch(
        tokens_BS=tokens_BS,
        loss_mask_BT=loss_mask_BT,
        engine_logprobs_BT=engine_logprobs_BT,
        prompt_lens_B=torch.tensor([len(s.prompt_ids) for s in samples]),
        response_lens_B=torch.tensor([len(s.output_ids) for s in samples]),
        finish_reasons=[s.finish_reason for s in samples],
        group_ids_B=torch.arange(B) // samples_per_prompt,
        trajectories=[s.trajectory or TrajectoryStats(1, 0, 0) for s in samples]
        if any(s.trajectory is not None for s in samples)
        else None,
    )


def _student_mask(s: Sample, b: int) -> torch.Tensor:
    """A trajectory's per-output-token student mask (float), checked against its ids and log-probs."""
    if not len(s.output_mask) == len(s.output_ids) == len(s.output_logprobs):
        raise ValueError(
            f"sample {b}: output_mask ({len(s.output_mask)}), output_ids ({len(s.output_ids)}) and "
            f"output_logprobs ({len(s.output_logprobs)}) must be one entry per output token"
        )
    return torch.tensor(s.output_mask, dtype=torch.float32)
