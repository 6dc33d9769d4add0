"""Where a response ends: the token that closes an assistant turn, and the ids rollouts stop at.

    stop = stop_tokens(cfg.data, student_tok, teacher_tok)
    SamplingParams(..., stop_token_ids=stop.ids)       # rollouts and validation stop here
    golden ids end with stop.golden_id                 # the SFT term teaches the same stop (stop.ids[0])

Why both ids: a base model's EOS is not its chat template's turn end. Qwen2.5-Math-7B (base) has EOS
`<|endoftext|>` (151643) while its ChatML template closes a turn with `<|im_end|>` (151645); golden
solutions end with the turn end, so a rollout that stops only at the EOS runs on past its answer to the
token budget and inflates the truncation rate the paper watches. SGLang already stops at the model's own
EOS ids (config.json / generation_config.json) and `stop_token_ids` adds the rest (ignore_eos drops both).

The ids, in order (duplicates dropped):
  1. the configured template's turn end (the golden's last token; see turn_end_token);
  2. the student tokenizer's EOS;
  3. with data.prompt_template=teacher, also the student's own template's turn end: a student that ends its
     turn in its own format has ended (the teacher may name that id differently; data.vocab masks it).
Pure functions of the tokenizers and the data config; nothing is read from disk.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaopd.data.config import DataConfig
from megaopd.data.templates import _template_tokenizer

_SENTINEL = "MEGAOPD_SENTINEL_7f3a"


def turn_end_token(tokenizer) -> str:
    """The token that closes an assistant turn in the tokenizer's chat template (e.g. <|im_end|>); the EOS
    token when there is no template or the template closes turns with plain text."""
    eos = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        return eos
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": _SENTINEL}], tokenize=False
        )
    except Exception:  # templates that refuse an assistant message: fall back to the EOS token
        return eos
    after = text[text.rfind(_SENTINEL) + len(_SENTINEL) :] if _SENTINEL in text else ""
    added = getattr(tokenizer, "added_tokens_encoder", {}) or {}
    for tok in sorted(added, key=len, reverse=True):  # longest first: "<|im_end|>" before "<|im"
        if after.lstrip(" ").startswith(tok):
            return tok
    return eos


def _token_id(tok, name: str | None, what: str) -> int:
    who = getattr(tok, "name_or_path", "?")
    if name is None:
        raise ValueError(
            f"tokenizer {who} has no eos_token: set one in its tokenizer_config.json (the {what} needs a stop token)"
        )
    tid = tok.convert_tokens_to_ids(name)
    if tid is None or (tok.unk_token_id is not None and tid == tok.unk_token_id and name != tok.unk_token):
        raise ValueError(
            f"tokenizer {who}: its {what} {name!r} is not in its vocabulary: fix its "
            f"tokenizer_config.json / chat template"
        )
    return int(tid)


@dataclass(frozen=True)
class StopTokens:
    """The ids a rollout stops at and the id every golden solution ends with (always ids[0])."""

    ids: tuple[int, ...]
    """stop_token_ids for SamplingParams: turn end of the configured template, student EOS, and (teacher
    template) the student's own turn end; no duplicates."""
    names: tuple[str, ...]
    """The student tokenizer's names of `ids`, for the start-up log."""

    @property
    def golden_id(self) -> int:
        """The token appended to every golden solution: the template's turn end, the first stop id."""
        return self.ids[0]

    def log_line(self) -> str:
        pairs = ", ".join(f"{n}={i}" for n, i in zip(self.names, self.ids))
        return f"[data] rollouts stop at {pairs}; golden solutions end with {self.names[0]}={self.ids[0]}"


def stop_tokens(cfg: DataConfig, tokenizer, teacher_tokenizer=None) -> StopTokens:
    """StopTokens of a job: `tokenizer` is the student's; `teacher_tokenizer` is needed only when
    cfg.prompt_template == "teacher" (the template whose turn end the goldens carry)."""
    if cfg.prompt_template == "plain":
        turn_end = _token_id(tokenizer, tokenizer.eos_token, "golden solutions' end (plain template: the EOS)")
    else:
        tpl = _template_tokenizer(cfg, tokenizer, teacher_tokenizer)
        turn_end = _token_id(tpl, turn_end_token(tpl), "chat template's turn end")
    ids = [turn_end, _token_id(tokenizer, tokenizer.eos_token, "EOS")]
    if cfg.prompt_template == "teacher" and getattr(tokenizer, "chat_template", None):
        ids.append(_token_id(tokenizer, turn_end_token(tokenizer), "chat template's turn end"))
    ids = list(dict.fromkeys(ids))
    return StopTokens(tuple(ids), tuple(str(tokenizer.convert_ids_to_tokens(i)) for i in ids))


def rollout_stop_ids(cfg: DataConfig, tokenizer, teacher_tokenizer=None) -> list[int]:
    """stop_token_ids for every generation of the job (rollouts and validation): stop_tokens(...).ids."""
    return list(stop_tokens(cfg, tokenizer, teacher_tokenizer).ids)


__all__ = ["StopTokens", "stop_tokens", "rollout_stop_ids", "turn_end_token"]
