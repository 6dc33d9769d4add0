"""What the trainer holds: every source loaded, filtered and tokenized, and a resumable batch cursor.

    data = PromptDataset.load(cfg.data, student_tokenizer)            # at start-up; raises DataError early
    data.stop.ids                        # stop_token_ids of every rollout; goldens end with data.stop.golden_id
    loader = PromptLoader(data, cfg.data, batch_size=64, dp_rank=r, dp_size=dp)
    batch = loader.next_batch()          # this rank's PromptExamples (prompt ids + golden ids/mask)
    ckpt["data"] = loader.state_dict();  loader.load_state_dict(ckpt["data"])

Every rank loads all sources (the sampler's order is computed the same everywhere, so nothing is
communicated); use the prepared format of tools/prepare_openr1_math.py for big data, so that the golden
filter does not run on every rank at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from megaopd.data.config import DataConfig, resolve_data_files
from megaopd.data.openr1 import DataError, LoadReport, load_records, token_counter
from megaopd.data.sampler import MixtureSampler, Ref
from megaopd.data.special_tokens import StopTokens, stop_tokens
from megaopd.data.tokenize import PromptExample, build_examples

EMPTY_FIX = (
    "give the file rows with `problem` and `answer` plus a `golden` (prepared format) or "
    "`generations` (OpenR1-Math schema); set data.require_golden=false for prompt-only files; "
    "raise data.max_prompt_len / data.max_golden_len if prompts were too long; or rebuild the data "
    "(tools/build_tiny_data.py, tools/prepare_openr1_math.py)"
)


@dataclass
class PromptDataset:
    """Tokenized prompts per source, in file order, with each source's load report."""

    names: list[str]
    examples: list[list[PromptExample]]
    reports: list[LoadReport]
    stop: Optional[StopTokens] = None
    """The ids rollouts stop at; every golden ends with stop.golden_id (one source for both)."""

    @classmethod
    def load(
        cls,
        cfg: DataConfig,
        tokenizer,
        teacher_tokenizer=None,
        log: Optional[Callable[[str], None]] = print,
        tools: Optional[list] = None,
    ) -> "PromptDataset":
        """Loads every source of cfg; raises DataError naming the files when a source has no usable row.
        tools: a multi-turn environment's tool schemas (megaopd.envs), rendered into every prompt."""
        cfg.validate()
        counter = token_counter(tokenizer)
        stop = stop_tokens(cfg, tokenizer, teacher_tokenizer)
        if log is not None:
            log(stop.log_line())
        names, examples, reports = [], [], []
        for src in cfg.sources:
            files = resolve_data_files(src.path)
            report = LoadReport(name=src.name, files=files)
            if not files:
                raise DataError(f"data source {src.path!r} matches no .jsonl/.json/.parquet file: fix the path")
            records = load_records(
                files,
                cfg.filter,
                counter,
                report,
                require_golden=cfg.require_golden,
                max_rows=src.max_rows,
                non_utf8=cfg.non_utf8,
            )
            exs, skipped, first = build_examples(
                records, src.name, cfg, tokenizer, teacher_tokenizer, stop_id=stop.golden_id, tools=tools
            )
            for reason, n in skipped.items():
                report.skipped[reason] += n
                report.first_skipped.setdefault(reason, f"uuid {first[reason]}")
            if src.max_rows:
                exs = exs[: src.max_rows]
            for ex in exs:
                ex.teacher = src.teacher
            report.kept = len(exs)
            if log is not None:
                log(f"[data] {report.summary()}")
            report.raise_if_empty(EMPTY_FIX)
            names.append(src.name)
            examples.append(exs)
            reports.append(report)
        return cls(names, examples, reports, stop)

    @property
    def sizes(self) -> list[int]:
        return [len(e) for e in self.examples]

    def __len__(self) -> int:
        return sum(self.sizes)

    def __getitem__(self, ref: Ref) -> PromptExample:
        source, index = ref
        return self.examples[source][index]


class PromptLoader:
    """The dataset plus its MixtureSampler: batches of PromptExamples for one DP rank, resumable."""

    def __init__(
        self,
        dataset: PromptDataset,
        cfg: DataConfig,
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        epoch_size: Optional[int] = None,
    ):
        if batch_size < 1 or batch_size % dp_size:
            raise ValueError(
                f"batch_size={batch_size} must be a positive multiple of dp_size={dp_size}: make "
                f"trainer.prompts_per_step a multiple of the data-parallel size"
            )
        self.dataset, self.batch_size, self.dp_rank, self.dp_size = dataset, batch_size, dp_rank, dp_size
        self.sampler = MixtureSampler(
            dataset.sizes, [s.weight for s in cfg.sources], seed=cfg.seed, shuffle=cfg.shuffle, epoch_size=epoch_size
        )

    def _examples(self, refs: Sequence[Ref]) -> list[PromptExample]:
        return [self.dataset[r] for r in refs]

    def next_batch(self) -> list[PromptExample]:
        """This rank's batch_size / dp_size prompts of the next global batch."""
        return self._examples(self.sampler.next_batch(self.batch_size, self.dp_rank, self.dp_size))

    def batch_at_step(self, step: int) -> list[PromptExample]:
        """The rank's prompts of step `step` (constant batch size), without touching the cursor."""
        return self._examples(self.sampler.batch_at_step(step, self.batch_size, self.dp_rank, self.dp_size))

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
