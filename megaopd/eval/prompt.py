"""Evaluation prompt: the problem, then the instruction to box the answer, in the tokenizer's chat template.

    text = problem.strip() + "\\n" + "Please reason step by step, and put your final answer within \\boxed{}."
    ids  = tokenizer(chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
           (the text alone when the tokenizer has no chat template: a base model)

Rendered by megaopd.data.templates, the code that renders training prompts, so validation during training
and `megaopd eval` see prompts exactly like the rollouts'. The trainer passes its own data config (teacher
template, system prompt, ...) through `evaluate(EvalModel(..., prompt_fn=...), ...)`.
"""

from __future__ import annotations

from megaopd.data.config import DEFAULT_INSTRUCTION, DataConfig
from megaopd.data.templates import encode_prompt, render_prompt

PROMPT_SUFFIX = DEFAULT_INSTRUCTION


def _data_config(tokenizer, use_chat_template: bool) -> DataConfig:
    chat = use_chat_template and getattr(tokenizer, "chat_template", None)
    return DataConfig(prompt_template="student" if chat else "plain")


def format_problem(problem: str) -> str:
    return f"{problem.strip()}\n{PROMPT_SUFFIX}"


def prompt_text(tokenizer, problem: str, use_chat_template: bool = True) -> str:
    """The prompt as text (chat template applied when the tokenizer has one and use_chat_template)."""
    return render_prompt(problem.strip(), _data_config(tokenizer, use_chat_template), tokenizer)


def prompt_ids(tokenizer, problem: str, use_chat_template: bool = True) -> list[int]:
    cfg = _data_config(tokenizer, use_chat_template)
    return encode_prompt(render_prompt(problem.strip(), cfg, tokenizer), cfg, tokenizer)
