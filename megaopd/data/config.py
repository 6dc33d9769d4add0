"""Config of the data section: which prompt files, mixed how, rendered with which template, cut where.

    data:
      sources:
        - {path: examples/tiny/data/opd.jsonl, weight: 1.0}
      prompt_template: student        # student | teacher | plain
      max_prompt_len: 256
      max_golden_len: 512

Paths are checked when the config is built (a missing file is a ValueError naming it and the fix);
`DataConfig.validate()` adds the checks that need the whole section (at least one source).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import List

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""The instruction OpenR1-Math-220k's generations were produced with (and Qwen2.5-Math's evaluation uses)."""

DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")

# The repository root: relative data paths of the shipped presets (examples/tiny/...) also resolve when a
# job is launched from another directory.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PREPARE_HINT = (
    "build the data first: `python tools/build_tiny_data.py` (tiny CPU data) or "
    "`python tools/prepare_openr1_math.py --input RAW --out DIR` (OpenR1-Math)"
)


def resolve_data_files(path: str) -> list[str]:
    """The data files a source path names: one file, every data file of a directory, or a glob; sorted.

    A relative path is tried from the working directory first, then from the repository root. Returns []
    when nothing matches (the caller raises with its own context).
    """
    path = os.path.expandvars(os.path.expanduser(path))
    candidates = [path] if os.path.isabs(path) else [path, os.path.join(REPO_ROOT, path)]
    for cand in candidates:
        if os.path.isdir(cand):
            files = sorted(os.path.join(cand, f) for f in os.listdir(cand) if f.endswith(DATA_FILE_SUFFIXES))
        elif any(ch in cand for ch in "*?["):
            files = sorted(f for f in glob.glob(cand) if os.path.isfile(f))
        elif os.path.isfile(cand):
            files = [cand]
        else:
            files = []
        if files:
            return files
    return []


@dataclass
class SourceConfig:
    """One prompt source: a file (or directory, or glob) of rows and its share of the mixture."""

    path: str = ""
    """A .jsonl/.json/.parquet file, a directory of them, or a glob (data/train-*.parquet). Rows are either
    the raw OpenR1-Math-220k schema (golden chosen on load by `filter`) or the prepared format written by
    tools/prepare_openr1_math.py (a `golden` column); rows with neither give prompts without a golden."""
    weight: float = 1.0
    """Share of this source in the prompt stream, relative to the other sources' weights."""
    name: str = ""
    """Label in metrics and logs; empty means the file name without its extension."""
    max_rows: int = 0
    """Use only the first N usable rows (quick runs); 0 means all."""
    teacher: str = ""
    """Name of the teacher that scores this source's samples (a `teachers:` entry); empty with one teacher."""

    def __post_init__(self):
        if not self.path:
            raise ValueError("data.sources[].path is empty: set it to a .jsonl/.parquet file; " + PREPARE_HINT)
        if not self.weight > 0:
            raise ValueError(
                f"data source {self.path!r} has weight={self.weight}: weights must be positive "
                f"(remove the source to leave it out)"
            )
        if self.max_rows < 0:
            raise ValueError(f"data source {self.path!r} has max_rows={self.max_rows}: use 0 (all) or a count")
        if not self.name:
            base = os.path.basename(self.path.rstrip("/")) or "source"
            for suffix in DATA_FILE_SUFFIXES:
                if base.endswith(suffix):
                    base = base[: -len(suffix)]
            self.name = base.replace("*", "")

    def check_files(self) -> None:
        """Raises when the path names no data file. Run at start-up (DataConfig.validate), not when the config
        is built: `megaopd config` shows a preset whose data is not there yet, with a warning."""
        if not resolve_data_files(self.path):
            raise ValueError(
                f"data source {self.path!r} does not exist (or holds no .jsonl/.json/.parquet "
                f"file): fix the path or {PREPARE_HINT}"
            )


@dataclass
class FilterConfig:
    """How a golden solution is chosen among a raw OpenR1-Math row's generations (paper 2604.08527 sec. 5.1,
    following Yan et al. 2025: drop generations over 8192 tokens or marked incorrect by Math-Verify)."""

    max_generation_tokens: int = 8192
    """Drop generations longer than this many tokens of the student's tokenizer (paper: 8192); 0 = no limit."""
    require_math_verify: bool = True
    """Drop generations that math-verify judged wrong (the row's correctness_math_verify list)."""
    reverify: bool = False
    """Re-run math-verify on each generation against `answer` instead of trusting correctness_math_verify
    (always done for rows that lack the column)."""
    require_complete: bool = True
    """Drop generations whose is_reasoning_complete is false (ours: the paper's two filters remove almost all
    of them already; a golden without a finished chain of thought would teach the student to stop early)."""
    golden_choice: str = "first"
    """Which surviving generation becomes the row's golden: first (dataset order) | shortest (in tokens)."""

    def __post_init__(self):
        if self.max_generation_tokens < 0:
            raise ValueError(
                f"data.filter.max_generation_tokens={self.max_generation_tokens}: use 0 (no limit) "
                f"or a token count such as 8192"
            )
        if self.golden_choice not in ("first", "shortest"):
            raise ValueError(f"data.filter.golden_choice={self.golden_choice!r}: choose first or shortest")


@dataclass
class DataConfig:
    """Prompt sources, their mixture, the prompt template, length limits and the data order's seed."""

    sources: List[SourceConfig] = field(default_factory=list)
    """Prompt sources, mixed by weight into one stream of prompts (each with its golden solution)."""
    prompt_template: str = "student"
    """student: the student tokenizer's chat template; teacher: the teacher tokenizer's chat template,
    tokenized by the teacher tokenizer (teacher-aligned prompting, paper 2604.13016); plain: the user text
    alone, no chat markup (base models without a chat template)."""
    teacher_prompt: str = "shared"
    """What the teacher scores the student's response after. shared: the student's prompt ids (the default;
    with prompt_template=teacher both already see the teacher's template); own: the same problem rendered
    with the teacher tokenizer's chat template (PromptExample.teacher_prompt_ids), so a teacher whose
    template differs from the student's (e.g. DeepSeek-R1-Distill's <｜User｜>...<｜Assistant｜><think>)
    reads the response in its own format while the student generates in its own."""
    instruction: str = DEFAULT_INSTRUCTION
    """Text substituted for {instruction} in user_format."""
    user_format: str = "{problem}\n{instruction}"
    """The user message; {problem} and {instruction} are replaced (other braces are kept, LaTeX is safe)."""
    system_prompt: str = ""
    """A system message before the user message; empty means none (the template's own default applies)."""
    max_prompt_len: int = 1024
    """Prompts longer than this many tokens are skipped (counted in the load report)."""
    max_golden_len: int = 8192
    """Token budget of a golden solution (with its EOS); see golden_overflow."""
    golden_overflow: str = "skip"
    """What to do with a golden longer than max_golden_len: skip the prompt | truncate the golden (its
    truncated tail then has no EOS, and the loss mask covers only what is kept)."""
    require_golden: bool = True
    """Skip prompts without a verified golden solution (needed by mixture distillation and SFT); set false
    for prompt-only sources (plain OPD, GRPO, validation)."""
    filter: FilterConfig = field(default_factory=FilterConfig)
    """Golden selection for rows in the raw OpenR1-Math schema."""
    seed: int = 1234
    """Seed of the data order: the same seed, data and batch size give the same batches at every step."""
    shuffle: bool = True
    """Shuffle each epoch (false: the files' order, sources interleaved by weight)."""
    non_utf8: str = "refuse"
    """Bytes of a .jsonl/.json source that are not UTF-8: refuse (the load stops in one line naming the file
    and line) | skip (each such line is a counted unusable row). Never replaced with U+FFFD silently."""

    def __post_init__(self):
        if self.prompt_template not in ("student", "teacher", "plain"):
            raise ValueError(f"data.prompt_template={self.prompt_template!r}: choose student, teacher or plain")
        if self.teacher_prompt not in ("shared", "own"):
            raise ValueError(
                f"data.teacher_prompt={self.teacher_prompt!r}: choose shared (the teacher scores after "
                f"the student's prompt) or own (after the teacher's chat template)"
            )
        if "{problem}" not in self.user_format:
            raise ValueError(
                f"data.user_format={self.user_format!r} has no {{problem}} placeholder: "
                f"add one, e.g. '{{problem}}\\n{{instruction}}'"
            )
        if self.max_prompt_len < 1 or self.max_golden_len < 1:
            raise ValueError(
                f"data.max_prompt_len={self.max_prompt_len} and data.max_golden_len="
                f"{self.max_golden_len} must be positive token counts"
            )
        if self.non_utf8 not in ("refuse", "skip"):
            raise ValueError(f"data.non_utf8={self.non_utf8!r}: choose refuse or skip")
        if self.golden_overflow not in ("skip", "truncate"):
            raise ValueError(f"data.golden_overflow={self.golden_overflow!r}: choose skip or truncate")
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"data.sources share the name(s) {dup}: give each source a distinct name")

    def validate(self) -> None:
        """Checks of the whole section, run at start-up (a default-built config has no sources yet)."""
        if not self.sources:
            raise ValueError(
                "data.sources is empty: add one, e.g. data.sources=[{path: "
                "examples/tiny/data/opd.jsonl}]; " + PREPARE_HINT
            )
        for source in self.sources:
            source.check_files()

    @property
    def weights(self) -> list[float]:
        return [s.weight for s in self.sources]


__all__ = ["DataConfig", "SourceConfig", "FilterConfig", "DEFAULT_INSTRUCTION", "resolve_data_files"]
