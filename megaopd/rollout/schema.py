"""SGLang /generate JSON <-> megaopd types, shared by the server (parsing) and the client (building).

One module for both directions so the client and `megaopd serve` cannot drift apart; the field names,
defaults and error classes are SGLang's (see /work/shared/design/SGLANG-PROTOCOL.md).

Request the client sends (one entry per sample, every sampling parameter explicit, because a server
fills omitted ones from the model's generation_config.json, e.g. Qwen's repetition_penalty):
    {"input_ids": [[...], ...], "sampling_params": [{...}, ...], "return_logprob": true,
     "logprob_start_len": -1, "stream": false}
Response entry:
    {"text": str, "output_ids": [int], "meta_info": {"id", "finish_reason", "prompt_tokens",
     "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
     "output_token_logprobs": [[logprob, id, null], ...]}}
"""
from __future__ import annotations

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
    """A request that fails validation. kind "value" -> {"error": {"message"}};
    kind "schema" -> {"object": "error", ..., "code": 400} (SGLang's two HTTP 400 bodies)."""

    def __init__(self, message: str, kind: str = "value"):
        super().__init__(message)
        self.kind = kind

    def body(self) -> dict:
        if self.kind == "schema":
            return {"object": "error", "message": str(self), "type": "Bad Request", "param": None, "code": 400}
        return {"error": {"message": str(self)}}


# SGLang sampling_params keys: those the embedded engine implements, and the rest, accepted only at
# their neutral value so a request that relies on them fails loudly instead of sampling differently.
IMPLEMENTED = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos",
               "n", "sampling_seed"}
NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_new_tokens": 0,
           "stop": None, "regex": None, "json_schema": None, "ebnf": None, "structural_tag": None,
           "logit_bias": None, "stream_interval": None}
IGNORED = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "custom_params",
           "return_hidden_states"}


def params_to_json(params: SamplingParams, seed: int | None) -> dict:
    """Every sampling parameter explicitly, for one sample (n=1); seed -> sampling_seed when given."""
    d = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
         "top_k": params.top_k, "min_p": params.min_p, "stop_token_ids": list(params.stop_token_ids),
         "stop": [], "ignore_eos": params.ignore_eos, "n": 1, "repetition_penalty": 1.0,
         "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_new_tokens": 0,
         "skip_special_tokens": True, "no_stop_trim": False}
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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise BadRequest(f"sampling_params.{key}={value!r} must be {'an integer' if kind is int else 'a number'}",
                         kind="schema")
    return kind(value)


def parse_params(d: Any, defaults: dict | None = None) -> ParsedParams:
    """Validates one sampling_params dict the way SGLang's SamplingParams.verify does; raises BadRequest."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise BadRequest(f"sampling_params must be an object (or a list of objects for a batch), got {type(d).__name__}",
                         kind="schema")
    d = {**(defaults or {}), **d}
    unknown = set(d) - IMPLEMENTED - set(NEUTRAL) - IGNORED
    if unknown:
        raise BadRequest(f"unexpected sampling_params {sorted(unknown)}", kind="schema")
    for key, neutral in NEUTRAL.items():
        value = d.get(key, neutral)
        if value not in (neutral, [], "") and value is not None:
            raise BadRequest(f"sampling_params.{key}={value!r} is not supported by megaopd serve "
                             f"(only {neutral!r}); use a real SGLang server for it")
    p = ParsedParams(
        max_new_tokens=_number(d, "max_new_tokens", 128, int), temperature=_number(d, "temperature", 1.0, float),
        top_p=_number(d, "top_p", 1.0, float), top_k=_number(d, "top_k", -1, int), min_p=_number(d, "min_p", 0.0, float),
        stop_token_ids=[], ignore_eos=bool(d.get("ignore_eos", False)), n=_number(d, "n", 1, int),
        seed=None if d.get("sampling_seed") is None else _number(d, "sampling_seed", 0, int))
    stop_ids = d.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in stop_ids):
        raise BadRequest(f"sampling_params.stop_token_ids={stop_ids!r} must be a list of integers", kind="schema")
    p.stop_token_ids = list(stop_ids)
    if p.temperature < 0.0:
        raise BadRequest(f"temperature must be non-negative, got {p.temperature}.")
    if not 0.0 < p.top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {p.top_p}.")
    if not 0.0 <= p.min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {p.min_p}.")
    if p.top_k < 1 and p.top_k != -1:
        raise BadRequest(f"top_k must be -1 (disable), or at least 1, got {p.top_k}.")
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


def sample_from_json(prompt_ids: list[int], entry: dict) -> Sample:
    """A Sample from one /generate response entry (needs return_logprob=true); raises ValueError if malformed."""
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
    return Sample(prompt_ids=list(prompt_ids), output_ids=output_ids,
                  output_logprobs=[float(x[0]) for x in lps], finish_reason=kind,
                  weight_version=meta.get("weight_version"))
