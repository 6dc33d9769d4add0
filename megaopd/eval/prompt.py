"""Evaluation prompt: the problem, then the instruction to box the answer, in the tokenizer's chat template.

    text = problem.strip() + "\\n" + "Please reason step by step, and put your final answer within \\boxed{}."
    ids  = tokenizer(chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
           (or tokenizer(text) with its special tokens when it has no chat template: a base model)
"""
from __future__ import annotations

PROMPT_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."


def format_problem(problem: str) -> str:
    return f"{problem.strip()}\n{PROMPT_SUFFIX}"


def prompt_text(tokenizer, problem: str, use_chat_template: bool = True) -> str:
    """The prompt as text (chat template applied when the tokenizer has one and use_chat_template)."""
    text = format_problem(problem)
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
    return text


def prompt_ids(tokenizer, problem: str, use_chat_template: bool = True) -> list[int]:
    text = prompt_text(tokenizer, problem, use_chat_template)
    chat = use_chat_template and getattr(tokenizer, "chat_template", None)
    # The chat template already wrote its special tokens (BOS included, when the model uses one).
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])
