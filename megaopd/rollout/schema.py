"""SGLang /generate JSON <-> megaopd types, shared by the server (parsing) and the client (building).

One module for both directions so the client and `megaopd serve` cannot drift apart; the field names,
defaults and error classes are SGLang's (docs/engines.md, "SGLang's HTTP API, as megaopd uses it").

Request the client sends (one entry per sample, every sampling parameter explicit, because a server
fills omitted ones from the model's generation_config.json, e.g. Qwen's repetition_penalty):
    {"input_ids": [[...], ...], "sampling_params": [{...}, ...], "return_logprob": true,
     "logprob_start_len": -1, "stream": false}
Response entry:
    {"text": str, "output_ids": [int], "meta_info": {"id", "finish_reason", "prompt_tokens",
     "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
     "output_token_logprobs": [[logprob, id, null], ...], "input_token_logprobs": [...], ...}}

Prefill scoring (served teachers, the parity probe): max_new_tokens 0, return_logprob and
logprob_start_len s give input_token_logprobs entries about prompt tokens s, s + 1, ..., and the entry AT
s is always [null, id, null] (SGLang 0.5.23, for any s, not only 0: nothing before s is scored, so the
token at s has no log-prob); input_top_logprobs / input_token_ids_logprobs have null there too. To score
the tokens from position p on, prefill_request asks from p - 1 and prefill_scores_from_json drops that
first entry: the one place that knows it. SGLang 0.5.23 also reports the id of the last vocabulary entry
(vocab_size - 1) as 0 in input_token_logprobs (`x if x < vocab_size - 1 else 0`, a guard meant for image
tokens' hashes); its log-prob is the sent token's, so an answered 0 is read as the id sent.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from megaopd.rollout.protocol import Sample, SamplingParams

WEIGHT_UPDATE_SESSION_SINCE = (0, 5, 20)
"""First SGLang version assumed to demand POST /begin_weight_update ... /end_weight_update around weight
updates (read in the 0.5.23 wheel). Earlier versions are not asked; from this one on the client opens
a session, and falls back to none when the server answers 404 (a build without the endpoints)."""


def parse_version(text) -> tuple[int, int, int] | None:
    """'0.5.23', 'v0.5.23.post1', '0.5.3rc0' -> (0, 5, 23) / (0, 5, 3); None when there is no x.y.z."""
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", str(text or ""))
    return tuple(int(g) for g in m.groups()) if m else None


class BadRequest(ValueError):
    """A request that fails validation, answered HTTP 400 with the body SGLang 0.5.23 gives that kind of error:
    kind "value" (a bad value: top_p 0)       -> {"error": {"message": ...}};
    kind "schema" (a request field's type)    -> {"object": "error", "message", "type": "Bad Request", ..., "code":
    400};
    kind "text" (a sampling_params field's type or name, which 0.5.23 checks with a strict decoder)
                                              -> {"error": "<text>"}."""

    def __init__(self, message: str, kind: str = "value"):
        super().__init__(message)
        if kind not in ("value", "schema", "text"):
            raise ValueError(f"BadRequest kind {kind!r}")
        self.kind = kind

    def body(self) -> dict:
        if self.kind == "schema":
            return {"object": "error", "message": str(self), "type": "Bad Request", "param": None, "code": 400}
        if self.kind == "text":
            return {"error": str(self)}
        return {"error": {"message": str(self)}}


# SGLang sampling_params keys: those the embedded engine implements, and the rest, accepted only at
# their neutral value so a request that relies on them fails loudly instead of sampling differently.
IMPLEMENTED = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "sampling_seed",
}
NEUTRAL = {
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "min_new_tokens": 0,
    "stop": None,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "stream_interval": None,
}
IGNORED = {
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "return_hidden_states",
}


def params_to_json(params: SamplingParams, seed: int | None) -> dict:
    """Every sampling parameter explicitly, for one sample (n=1); seed -> sampling_seed when given."""
    d = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "stop_token_ids": list(params.stop_token_ids),
        "stop": [],
        "ignore_eos": params.ignore_eos,
        "n": 1,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "min_new_tokens": 0,
        "skip_special_tokens": True,
        "no_stop_trim": False,
    }
    if seed is not None:
        d["sampling_seed"] = int(seed)
    return d


@dataclass
class ParsedParams:
    """One sampling_params dict, validated. max_new_tokens may be 0 here (SGLang allows it: scoring)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    stop_token_ids: list[int]
    ignore_eos: bool
    n: int
    seed: int | None


def _number(d: dict, key: str, default, kind):
    value = d.get(key, default)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not float(value).is_integer())
    ):
        raise BadRequest(
            f"invalid type: sampling_params.{key}={value!r}, expected {'an integer' if kind is int else 'a number'}",
            kind="text",
        )
    return kind(value)


def _num(x: float):
    """A number as SGLang prints it in its messages: -1 for an integral value, else as is."""
    return int(x) if float(x).is_integer() else x


def parse_params(d: Any, defaults: dict | None = None) -> ParsedParams:
    """Validates one sampling_params dict the way SGLang's SamplingParams.verify does; raises BadRequest."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise BadRequest(
            f"invalid type: sampling_params must be an object (or a list of objects for a batch), "
            f"got {type(d).__name__}",
            kind="text",
        )
    d = {**(defaults or {}), **d}
    unknown = set(d) - IMPLEMENTED - set(NEUTRAL) - IGNORED
    if unknown:
        raise BadRequest(f"unknown field(s) {sorted(unknown)} in sampling_params", kind="text")
    for key, neutral in NEUTRAL.items():
        value = d.get(key, neutral)
        if value not in (neutral, [], "") and value is not None:
            raise BadRequest(
                f"sampling_params.{key}={value!r} is not supported by megaopd serve "
                f"(only {neutral!r}); use a real SGLang server for it"
            )
    p = ParsedParams(
        max_new_tokens=_number(d, "max_new_tokens", 128, int),
        temperature=_number(d, "temperature", 1.0, float),
        top_p=_number(d, "top_p", 1.0, float),
        top_k=_number(d, "top_k", -1, int),
        min_p=_number(d, "min_p", 0.0, float),
        stop_token_ids=[],
        ignore_eos=bool(d.get("ignore_eos", False)),
        n=_number(d, "n", 1, int),
        seed=None if d.get("sampling_seed") is None else _number(d, "sampling_seed", 0, int),
    )
    stop_ids = d.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in stop_ids):
        raise BadRequest(
            f"invalid type: sampling_params.stop_token_ids={stop_ids!r}, expected a list of integers", kind="text"
        )
    p.stop_token_ids = list(stop_ids)
    if p.temperature < 0.0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {_num(p.temperature)}.")
    if not 0.0 < p.top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {p.top_p}.")
    if not 0.0 <= p.min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {_num(p.min_p)}.")
    if p.top_k < 1 and p.top_k != -1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {p.top_k}.")
    if p.max_new_tokens < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
    if p.n < 1:
        raise BadRequest(f"n must be at least 1, got {p.n}.")
    return p


def finish_reason_json(reason: str, matched: int | None, max_new_tokens: int, message: str = "") -> dict:
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": max_new_tokens}
    return {"type": "abort", "message": message or "aborted"}


def sample_from_json(prompt_ids: list[int], entry: dict, vocab_size: int = 0) -> Sample:
    """A Sample from one /generate response entry (needs return_logprob=true); raises ValueError if malformed,
    or when an output id lies outside [0, vocab_size) (vocab_size > 0: the student's vocabulary; an engine
    serving another model or tokenizer would otherwise fail later as a bare IndexError in an embedding)."""
    try:
        output_ids = [int(t) for t in entry["output_ids"]]
        meta = entry["meta_info"]
        reason = meta["finish_reason"]
        kind = reason.get("type") if isinstance(reason, dict) else None
        lps = meta.get("output_token_logprobs")
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed /generate response entry (missing {e}): {str(entry)[:300]}") from e
    if kind not in ("stop", "length", "abort"):
        raise ValueError(f"unknown finish_reason {reason!r} in /generate response")
    if lps is None:
        raise ValueError("the /generate response has no output_token_logprobs; send return_logprob=true")
    if len(lps) != len(output_ids):
        raise ValueError(f"{len(lps)} output_token_logprobs for {len(output_ids)} output_ids")
    if vocab_size > 0:
        bad = [t for t in output_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"output_ids {bad[:4]} lie outside the student's vocabulary [0, {vocab_size}): the engine serves "
                f"another model or tokenizer; point it at the student's (rollout.urls)"
            )
    return Sample(
        prompt_ids=list(prompt_ids),
        output_ids=output_ids,
        output_logprobs=_logprobs(
            [x[0] if isinstance(x, (list, tuple)) else x for x in lps], "output_token_logprobs", 0
        ),
        finish_reason=kind,
        weight_version=meta.get("weight_version"),
    )


@dataclass
class PrefillScores:
    """One sequence's scores of its tokens seq[first:] by prefill alone, at temperature 1 (SGLang's input
    log-probs): entry j is about token first + j given the tokens before it."""

    logprobs: list[float]
    """log p(seq[first + j] | seq[:first + j])."""
    top_ids: list[list[int]] | None = None
    """With top-K: the K most likely ids of the distribution that predicts seq[first + j], most likely first."""
    top_logprobs: list[list[float]] | None = None
    """Their log-probs, in the same order."""


def prefill_request(seqs: list[list[int]], firsts: list[int], topk: int = 0) -> dict:
    """The /generate body that scores tokens firsts[i]: of seqs[i] (1 <= firsts[i] <= len: token 0 has no
    prefix), with the top-`topk` of each distribution when topk > 0. One batch entry per sequence, every
    sampling parameter explicit (max_new_tokens 0: prefill only), logprob_start_len one before the first
    token to score (see the module docstring)."""
    if len(seqs) != len(firsts):
        raise ValueError(f"prefill_request: {len(seqs)} sequences but {len(firsts)} first positions")
    bad = [(len(s), f) for s, f in zip(seqs, firsts) if not 1 <= f <= len(s)]
    if bad:
        raise ValueError(
            f"prefill_request: first positions must be in [1, len(seq)] (token 0 has no prefix to "
            f"be scored from); got (len, first) {bad[:4]}"
        )
    if topk < 0:
        raise ValueError(f"prefill_request: topk={topk} must be >= 0")
    sp = dict(params_to_json(SamplingParams(temperature=1.0), seed=None), max_new_tokens=0)
    body = {
        "input_ids": [list(s) for s in seqs],
        "sampling_params": [dict(sp) for _ in seqs],
        "return_logprob": True,
        "logprob_start_len": [f - 1 for f in firsts],
        "stream": False,
    }
    if topk:
        body["top_logprobs_num"] = topk
    return body


def prefill_scores_from_json(entry: Any, seq: list[int], first: int, topk: int = 0) -> PrefillScores:
    """PrefillScores of one answer entry to prefill_request; ValueError naming what is malformed."""
    try:
        meta = entry["meta_info"]
        lps = meta["input_token_logprobs"]
        tops = meta.get("input_top_logprobs") if topk else None
    except (KeyError, TypeError) as e:
        raise ValueError(f"an answer has no meta_info.input_token_logprobs ({e})") from None
    n = len(seq) - first
    if not isinstance(lps, list) or len(lps) != n + 1:
        raise ValueError(
            f"input_token_logprobs has {len(lps) if isinstance(lps, list) else lps!r} entries for "
            f"the {n} tokens scored plus the one at logprob_start_len={first - 1} "
            f"(sequence of {len(seq)})"
        )
    lps = lps[1:]  # the entry at logprob_start_len: [null, id, null] on SGLang (nothing before it is scored)
    got = [int(e[1]) for e in lps]
    if not all(a == b or a == 0 for a, b in zip(got, seq[first:])):  # SGLang names the last vocabulary id 0
        i = next(i for i, (a, b) in enumerate(zip(got, seq[first:])) if a not in (b, 0))
        raise ValueError(
            f"input_token_logprobs names other token ids than the sequence sent: at token {first + i} "
            f"of {len(seq)}, sent {list(seq[first + i : first + i + 4])}, answered {got[i : i + 4]}"
        )
    if any(e[0] is None for e in lps):
        raise ValueError("input_token_logprobs has a null log-prob after logprob_start_len")
    out = PrefillScores(logprobs=_logprobs([e[0] for e in lps], "input_token_logprobs", first))
    if topk:
        if not isinstance(tops, list) or len(tops) != n + 1:
            raise ValueError(f"input_top_logprobs is missing or has a wrong length for top_logprobs_num={topk}")
        tops = tops[1:]
        if any(t is None or len(t) < topk for t in tops):
            raise ValueError(
                f"input_top_logprobs has fewer than top_logprobs_num={topk} entries at some of the {n} positions scored"
            )
        out.top_logprobs = [
            _logprobs([e[0] for e in t], "input_top_logprobs", 0, rank_at=first + j) for j, t in enumerate(tops)
        ]
        for j, values in enumerate(out.top_logprobs):
            if any(b > a + LOGPROB_TOLERANCE for a, b in zip(values, values[1:])):
                raise ValueError(
                    f"input_top_logprobs at token {first + j} is not sorted most likely first ({values[:4]}): "
                    f"served top-K must come ranked; check the server (or a proxy before it)"
                )
        out.top_ids = [[int(e[1]) for e in t[:topk]] for t in tops]
        out.top_logprobs = [values[:topk] for values in out.top_logprobs]
    return out


def prefill_scores_list(out: list, seqs: list[list[int]], firsts: list[int], topk: int = 0) -> list[PrefillScores]:
    """prefill_scores_from_json of each answer entry; a ValueError names the row (the entry's index)."""
    scores = []
    for row, (entry, seq, first) in enumerate(zip(out, seqs, firsts)):
        try:
            scores.append(prefill_scores_from_json(entry, seq, first, topk))
        except ValueError as e:
            raise ValueError(f"row {row} of {len(seqs)}: {e}") from None
    return scores


LOGPROB_TOLERANCE = 1e-4
"""How far above 0 a served log-prob may round (a probability of 1 in float16/bfloat16 arithmetic)."""


def _logprobs(values: list, what: str, first: int, rank_at: int | None = None) -> list[float]:
    """Served log-probs as floats, each finite and <= LOGPROB_TOLERANCE: numbers from outside are checked
    where they enter (a proxy or a broken server answering +3.0 or NaN trained the student on them)."""
    out = []
    for j, v in enumerate(values):
        # values: one per token from `first` on; or (rank_at: that token) the top-K's, by rank
        where = f"{what} at token {first + j}" if rank_at is None else f"{what} at token {rank_at}, rank {j}"
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{where} is {v!r}, not a number") from None
        if not (math.isfinite(x) and x <= LOGPROB_TOLERANCE):
            raise ValueError(
                f"{where} is {x!r}: a log-prob must be finite and <= 0; the server (or a proxy before it) "
                f"serves impossible scores: check it"
            )
        out.append(x)
    return out
