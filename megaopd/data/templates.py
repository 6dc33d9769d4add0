"""Prompt rendering: a problem -> the exact text (and token ids) the student generates after.

    text = render_prompt("Compute 2 + 3.", cfg, student_tok)          # chat template of the student
    ids = encode_prompt(text, cfg, student_tok, teacher_tok)          # token ids the engines receive

Three templates (DataConfig.prompt_template):
  student  the student tokenizer's chat template with add_generation_prompt (the default);
  teacher  the teacher tokenizer's chat template, and the teacher tokenizer's ids: teacher-aligned
           prompting (paper 2604.13016), so the teacher scores the student's tokens in the prompt format it
           was trained on; OPD already requires both to share one vocabulary;
  plain    the user text alone, for base models without a chat template.
The user message is DataConfig.user_format with {problem} and {instruction} substituted (str.replace, not
str.format: problems are LaTeX and full of braces).
"""

from __future__ import annotations

from megaopd.data.config import DataConfig


def user_message(problem: str, cfg: DataConfig) -> str:
    return cfg.user_format.replace("{instruction}", cfg.instruction).replace("{problem}", problem)


def _template_tokenizer(cfg: DataConfig, tokenizer, teacher_tokenizer):
    if cfg.prompt_template != "teacher":
        return tokenizer
    if teacher_tokenizer is None:
        raise ValueError(
            "data.prompt_template=teacher needs the teacher's tokenizer: pass teacher_tokenizer "
            "(the teacher model directory's tokenizer), or set data.prompt_template=student"
        )
    return teacher_tokenizer


def render_prompt(problem: str, cfg: DataConfig, tokenizer, teacher_tokenizer=None, tools=None) -> str:
    """The prompt text, ending where the response begins (after the assistant header). tools: JSON schemas
    of a multi-turn environment's tools (megaopd.envs), which the chat template renders (Qwen: in the system
    turn); None: no tools."""
    who = "teacher" if cfg.prompt_template == "teacher" else "student"
    return render_user(
        user_message(problem, cfg), cfg, _template_tokenizer(cfg, tokenizer, teacher_tokenizer), tools, who
    )


def render_user(content: str, cfg: DataConfig, tok, tools=None, who: str = "teacher") -> str:
    """A user message rendered as a prompt by `tok`'s chat template (data.system_prompt first), ending after
    the assistant header; data.prompt_template=plain: the text alone. The student's prompts and a teacher's
    own context (megaopd.data.teacher_view) both go through here."""
    if cfg.prompt_template == "plain":
        return (cfg.system_prompt + "\n" if cfg.system_prompt else "") + content
    if not getattr(tok, "chat_template", None):
        raise ValueError(
            f"the {who} tokenizer ({getattr(tok, 'name_or_path', '?')}) has no chat template: "
            f"set data.prompt_template=plain, or use a tokenizer that has one"
        )
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    messages.append({"role": "user", "content": content})
    if tools:
        return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompt(text: str, cfg: DataConfig, tokenizer, teacher_tokenizer=None) -> list[int]:
    """Token ids of a rendered prompt. No special tokens are added: a chat template writes its own BOS, and
    a second one would put the prompt out of the distribution both models were trained on."""
    tok = _template_tokenizer(cfg, tokenizer, teacher_tokenizer)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def strip_think_overlap(prompt_text: str, golden: str, think: str = "<think>") -> str:
    """Drops a golden's leading `<think>` when the prompt already ends with one (R1-distill templates open
    the think block in the generation prompt): otherwise the golden would teach a doubled <think>."""
    head = golden.lstrip()
    if prompt_text.rstrip().endswith(think) and head.startswith(think):
        return head[len(think) :].lstrip("\n")
    return golden


def render_and_encode(
    problem: str,
    cfg: DataConfig,
    tokenizer,
    teacher_tokenizer=None,
) -> tuple[str, list[int]]:
    text = render_prompt(problem, cfg, tokenizer, teacher_tokenizer)
    return text, encode_prompt(text, cfg, tokenizer, teacher_tokenizer)


__all__ = ["user_message", "render_prompt", "render_user", "encode_prompt", "strip_think_overlap", "render_and_encode"]
