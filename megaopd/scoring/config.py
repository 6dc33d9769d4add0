"""scoring: the job config's section of one teacher, in the job (an InJobTeacher: a model in its own layout)
or served (a RemoteTeacher: its servers), from which trainer/roles.py builds the job's TeacherSet."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import List

from megaopd.data.teacher_view import TEACHER_TOKENIZERS, check_context_fields
from megaopd.models.config import ModelConfig
from megaopd.rollout.config import check_env_name


class TeacherEngine(StrEnum):
    """Where a teacher runs (teacher.engine), parsed once by TeacherConfig. The job asks a kind's properties,
    never its name: a new kind is one member here with its properties (docs/extending.md)."""

    MEGATRON = "megatron"
    REMOTE = "remote"

    @property
    def in_job(self) -> bool:
        """A Megatron model inside the job, in its own tp/pp/ep layout on the training GPUs: trainer.roles loads
        it and `megaopd plan` counts it. Else served: its servers at teacher.urls score the rows by prefill."""
        return self is TeacherEngine.MEGATRON


TEACHER_ENGINES = tuple(TeacherEngine)
REFERENCE = "reference"
"""teacher.path: reference: the teacher is the reference model (the student's initial weights)."""


@dataclass
class TeacherConfig(ModelConfig):
    """A teacher: a Megatron model inside the job (engine megatron: path/tp/pp/ep/dtype as any model) or
    SGLang servers that score the responses by prefill (engine remote: urls; path then only names the HF
    directory whose tokenizer is checked against the student's)."""

    name: str = ""
    """The teacher's name in `teachers:` lists, data.sources[].teacher and per-teacher metrics
    (rollout/teacher_logprob_mean/<name>); the single `teacher:` section is named "teacher"."""
    engine: str = TeacherEngine.MEGATRON
    """A TeacherEngine (parsed from its name in __post_init__): megatron (in the job, in its own tp/pp/ep
    layout) or remote (SGLang servers at `urls`, or `megaopd serve`; scores at temperature 1 only, no
    entropy, no log-probs at the student's top-k)."""
    urls: List[str] = field(default_factory=list)
    """engine remote: base URLs of the teacher's servers (or one router), e.g. [http://node3:30000];
    requests are spread over them and a request whose server fails is retried on another."""
    rows_per_request: int = 8
    """engine remote: responses per /generate request (the unit spread over servers and retried)."""
    request_timeout_s: float = 600.0
    """engine remote: longest wait for one scoring request."""
    retries: int = 1
    """engine remote: extra attempts on the same server after a connection error or 5xx before the
    request moves to another server."""
    api_key_env: str = "MEGAOPD_API_KEY"
    """engine remote: the environment variable holding the servers' API key (SGLang / `megaopd serve`
    --api-key), sent as `Authorization: Bearer <key>`; unset or empty variable, or "": no key. The key
    itself never goes in a config (config.yaml is copied into the run folder)."""
    context: str = ""
    """The teacher's own prompt of each row, a template over the data row's fields {problem}, {golden},
    {answer} and {instruction} (e.g. "{problem}\n\nA correct solution:\n{golden}\n\nSolve it again."),
    rendered as the user message of the teacher's chat template; the teacher then scores the student's
    response after it (privileged-context self-distillation). Empty: the student's own prompt (the default)."""
    tokenizer: str = "student"
    """student (the default): the teacher reads the student's token ids; own: its own tokenizer and chat
    template from its folder (the response is re-tokenized for it and its scores mapped back)."""

    def __post_init__(self):
        super().__post_init__()
        if self.engine not in TEACHER_ENGINES:
            raise ValueError(
                f"teacher engine={self.engine!r}: choose megatron (in the job) or remote (SGLang "
                f"servers at teacher.urls)"
            )
        self.engine = TeacherEngine(self.engine)
        if not self.engine.in_job:
            bad = [u for u in self.urls if not str(u).startswith(("http://", "https://"))]
            if bad:
                raise ValueError(f"teacher urls {bad}: each must start with http:// or https://")
        elif self.urls:
            raise ValueError(
                f"teacher urls={list(self.urls)} are set but engine={self.engine!r}: set "
                f"engine=remote to score with those servers, or drop the urls"
            )
        check_env_name("teacher api_key_env", self.api_key_env)
        check_context_fields(f"teachers[{self.name}]" if self.name else "teacher", self.context)
        if self.tokenizer not in TEACHER_TOKENIZERS:
            raise ValueError(
                f"teacher tokenizer={self.tokenizer!r}: choose student (the student's token ids) or own (the "
                f"teacher's tokenizer and chat template from its folder)"
            )
        if self.path == REFERENCE and not self.engine.in_job:
            raise ValueError(
                "teacher path=reference is the reference model inside the job: it needs engine=megatron "
                "(a served teacher's path names the HF directory of its tokenizer)"
            )
        if self.rows_per_request < 1 or self.request_timeout_s <= 0 or self.retries < 0:
            raise ValueError("teacher rows_per_request must be >= 1, request_timeout_s > 0, retries >= 0")

    @property
    def is_reference(self) -> bool:
        """The teacher is the reference model (teacher.path: reference)."""
        return self.path == REFERENCE

    @property
    def own_view(self) -> bool:
        """The teacher reads a sequence of its own: a context, or its own tokenizer (TeacherPrompt)."""
        return bool(self.context) or self.tokenizer == "own"

    @property
    def configured(self) -> bool:
        """Whether this section names a teacher at all (a path, or remote servers)."""
        return bool(self.path) or (not self.engine.in_job and bool(self.urls))

    @property
    def in_job(self) -> bool:
        """The teacher is a model inside the job (TeacherEngine.in_job)."""
        return self.engine.in_job
