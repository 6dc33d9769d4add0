"""RolloutBatch: the one record that carries a step's responses from the engines to the loss.

Shape legend: B sequences, S = padded length of prompt + response, T = S - 1 predicted positions
(position t holds the logits of tokens[:, t] and predicts tokens[:, t + 1]), K top-K size.
Sequences are right-padded, so causal attention never lets padding reach a real position.

    batch = build_rollout_batch(samples, pad_id, samples_per_prompt)   # engines -> record (every rank)
    batch.actor = score_tokens(...)      # megaopd.scoring fills the per-token scores ...
    batch.teacher = score_tokens(...)
    batch.rewards_B = ...                # ... and the trainer the verifiable rewards

Golden (SFT) rows travel beside it in megaopd.data.GoldenBatch; the micro-batches of the training step
are cut from both by megaopd.trainer.micro_batches.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megaopd.engine.rows import FinishReason
from megaopd.parallel.dist import world_size
from megaopd.rollout.protocol import Sample


@dataclass
class TokenScores:
    """Per-token outputs of one model (the actor or the teacher) at every position of the rows it holds.

    In training a rank holds only the rows its actor data-parallel replica trains (`rows`, see RowOwners):
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
            raise KeyError(f"rows {missing[:8]} are not held on this rank (it holds {len(self.rows)} rows, the ones "
                           f"its actor data-parallel replica trains): build micro-batches from the same RowOwners "
                           f"the scores were routed with (trainer/micro_batches.row_owners)")
        return torch.tensor([where[int(r)] for r in batch_rows.tolist()], dtype=torch.long)

    def topk_support(self, k: int) -> "TokenScores | None":
        """The first k of the top-k ids (the student's support, which LSM asks the teacher to score); None
        when k is 0."""
        if not k:
            return None
        return TokenScores(self.logprobs_BT, rows=self.rows, topk_ids_BTK=self.topk_ids_BTK[..., :k])

    def take(self, batch_rows: list[int]) -> "TokenScores":
        """The scores of the given batch rows only (rows set to them)."""
        i = self.index(batch_rows)
        fields = ("logprobs_BT", "entropy_BT", "topk_ids_BTK", "topk_logprobs_BTK", "at_ids_logprobs_BTK")
        return TokenScores(**{f: None if getattr(self, f) is None else getattr(self, f)[i] for f in fields},
                           rows=list(batch_rows))


@dataclass(frozen=True)
class RowOwners:
    """Which actor data-parallel replica trains each row of a step's batch (made by
    trainer/micro_batches.row_owners, the same partition its micro-batches take). Every TP/PP rank of a
    replica holds that replica's rows' scores: the loss runs on the last PP stage, and each TP rank needs them."""

    owner_B: tuple[int, ...]
    """Actor DP rank that trains each batch row."""
    dp_rank: int
    """This rank's actor DP rank."""
    dp_size: int
    """Actor DP size."""
    sends: bool
    """This rank speaks for its replica when owned rows' data must move (actor TP rank 0 and PP rank 0)."""
    ranks: tuple[tuple[int, bool], ...] | None = None
    """Per global rank, its (dp_rank, sends): the same layout every step, so the trainer gathers it once
    (scoring.exchange.owner_ranks); None: every routing pass gathers it again (a small all_gather)."""

    @staticmethod
    def replicated(num_rows: int, rank: int) -> "RowOwners":
        """Every rank holds every row (one replica, global rank 0 speaking for it): `megaopd logprobs`, tests."""
        world = world_size()
        return RowOwners(tuple([0] * num_rows), 0, 1, rank == 0, tuple((0, r == 0) for r in range(world)))

    def rows(self, dp_rank: int | None = None) -> list[int]:
        """Rows owned by `dp_rank` (default: this rank's replica), increasing."""
        d = self.dp_rank if dp_rank is None else dp_rank
        return [b for b, o in enumerate(self.owner_B) if o == d]

    def subset(self, batch_rows: list[int]) -> "RowOwners":
        """The owners of a sub-batch made of `batch_rows` (its row i is batch row batch_rows[i])."""
        return RowOwners(tuple(self.owner_B[b] for b in batch_rows), self.dp_rank, self.dp_size, self.sends,
                         self.ranks)


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
    """Generated tokens per row, the stop token included [B] (long)."""
    finish_reasons: list[FinishReason]
    """Why each response ended: "stop" (EOS or a stop token), "length" (budget used up), "abort" [B]."""
    group_ids_B: torch.Tensor
    """Index of the prompt each sequence answers (its GRPO group) [B] (long)."""
    texts: list[str] = field(default_factory=list)
    """The decoded responses [B] (repetition metrics, rewards, samples); filled by the trainer."""
    actor: TokenScores | None = None
    """The actor's forward-only scores before the update: log pi_old (+ its top-k and entropy)."""
    teacher: TokenScores | None = None
    """The teacher's scores: log q (+ top-K, entropy, log-probs at the student's top-k)."""
    rewards_B: torch.Tensor | None = None
    """Verifiable reward per sequence [B] (float32; grpo, metrics)."""
    teacher_rows: dict[str, list[int]] = field(default_factory=dict)
    """Rows scored by each teacher, by name (increasing row order); filled with `teacher` by the trainer."""

    @property
    def size(self) -> int:
        return self.tokens_BS.shape[0]

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
        tokens_BS[b, p:p + r] = torch.tensor(s.output_ids)
        # Position t predicts token t + 1: the response tokens p..p+r-1 are predicted at p-1..p+r-2.
        loss_mask_BT[b, p - 1:p + r - 1] = 1.0
        engine_logprobs_BT[b, p - 1:p + r - 1] = torch.tensor(s.output_logprobs, dtype=torch.float32)
    return RolloutBatch(
        tokens_BS=tokens_BS,
        loss_mask_BT=loss_mask_BT,
        engine_logprobs_BT=engine_logprobs_BT,
        prompt_lens_B=torch.tensor([len(s.prompt_ids) for s in samples]),
        response_lens_B=torch.tensor([len(s.output_ids) for s in samples]),
        finish_reasons=[s.finish_reason for s in samples],
        group_ids_B=torch.arange(B) // samples_per_prompt,
    )


def dp_rows(num_rows: int, dp_rank: int, dp_size: int) -> range:
    """The contiguous block of rows data-parallel replica `dp_rank` of `dp_size` handles."""
    per = -(-num_rows // dp_size)
    return range(min(dp_rank * per, num_rows), min((dp_rank + 1) * per, num_rows))


def pad_rows(x: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    """x with extra rows of `value` so that it has `rows` rows (equal-shaped micro-batches)."""
    if x.shape[0] == rows:
        return x
    pad = torch.full((rows - x.shape[0], *x.shape[1:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad])
