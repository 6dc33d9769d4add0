"""POST /generate of `megaopd serve`: the request checked as SGLang 0.5.23 checks it, its prompts x n
expanded into the runner's rows, and the answer built with SGLang's keys at every level.

    answer = generate(runner, scheduler.run, json.loads(body))

parse_generate -> GenerateRequest (every refusal happens here or in expand, before anything runs);
expand -> one Entry per answer entry (prompt-major; n > 1 gives sample j of prompt i the seed
derive_seed(seed, i, j), n == 1 keeps the client's seed); the rows with max_new_tokens > 0 run; answer
-> the JSON (one object for a bare prompt, else a list). Prefill scoring (max_new_tokens 0,
return_logprob, logprob_start_len >= 0) runs no row: its log-probs come from ModelRunner.prompt_scores.
docs/engines.md describes the API and where `megaopd serve` departs from SGLang on purpose.

Beyond SGLang's checks (rollout.schema.parse_params), refused with HTTP 400 naming the field: a NaN or
infinite temperature / top_p / min_p (JSON parsers read NaN, Infinity and 1e999), a sampling_seed outside
64 bits, more than MAX_ENTRIES samples in one request, and a prompt longer than the model's context (a
generated row is bounded by prompt + max_new_tokens in ModelRunner.check_row; a prefill-scored one here).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from megaopd.engine.memory import EngineReleasedError
from megaopd.engine.rows import RowRequest, RowResult
from megaopd.engine.runner import ModelRunner
from megaopd.rollout.embedded import row_request
from megaopd.rollout.protocol import expand_samples
from megaopd.rollout.schema import BadRequest, ParsedParams, finish_reason_json, parse_params

MAX_ENTRIES = 16384
"""Most samples (prompts x n) one /generate request may ask for: 16x what megaopd's client sends at most
(HttpEngineConfig.max_entries_per_request), and far below what would exhaust the server's memory."""


@dataclass
class GenerateRequest:
    """A checked /generate body: one entry per prompt in every list."""

    prompts: list[list[int]]
    single: bool
    """The prompt came bare (not in a list): a one-entry answer is an object, not a list."""
    params: list[ParsedParams]
    return_logprob: list[bool]
    start_len: list[int | None]
    """logprob_start_len: -1 = output tokens only; s >= 0 = prompt tokens from s on too."""
    rids: list[str | None]
    top_num: list[int]
    """top_logprobs_num (prefill scoring only)."""
    at_ids: list[list[int] | None]
    """token_ids_logprob (prefill scoring only)."""


@dataclass
class Entry:
    """One entry of the answer: a sample of prompt `prompt`, as the row that generates it."""

    prompt: int
    row: RowRequest
    rid: str


def generate(engine: ModelRunner, run: Callable[[list[RowRequest]], list[RowResult]], req: Any) -> Any:
    """The answer to a /generate body; BadRequest (HTTP 400) for what SGLang refuses, and for what
    megaopd serve does not implement. run: the scheduler's (rows decode in the next batch)."""
    gen = parse_generate(engine, req)
    entries = expand(engine, gen)
    t0 = time.perf_counter()
    run_rows = [e.row for e in entries if e.row.max_new_tokens > 0]
    try:
        results = run(run_rows) if run_rows else []
    except EngineReleasedError as e:
        raise BadRequest(str(e)) from e
    return answer(engine, gen, entries, results, latency=time.perf_counter() - t0)


def parse_generate(engine: ModelRunner, req: Any) -> GenerateRequest:
    if not isinstance(req, dict):
        raise BadRequest("the request body must be a JSON object", kind="schema")
    given = [k for k in ("text", "input_ids", "input_embeds") if req.get(k) is not None]
    if not given:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if len(given) > 1:  # SGLang 0.5.23 silently uses input_ids: refused here, so a caller's mix-up shows
        raise BadRequest(f"give exactly one of text, input_ids, input_embeds (got {given})")
    if req.get("stream"):
        raise BadRequest("stream=true is not supported by megaopd serve")
    if req.get("input_embeds") is not None:
        raise BadRequest("input_embeds is not supported by megaopd serve")
    prompts, single = _prompts(engine, req)
    n = len(prompts)
    sp = req.get("sampling_params")
    if isinstance(sp, list):
        if single or len(sp) != n:
            raise BadRequest(f"sampling_params is a list of {len(sp)} for {n} prompt(s)")
        params = [parse_params(p) for p in sp]
    else:
        params = [parse_params(sp)] * n
    for p in params:
        check_values(p)
    if sum(p.n for p in params) > MAX_ENTRIES:
        raise BadRequest(
            f"the request asks for {sum(p.n for p in params)} samples (prompts x n); megaopd serve "
            f"takes at most {MAX_ENTRIES} per request: split it"
        )
    context = _context(engine)
    long = [len(p) for p in prompts if context is not None and len(p) > context]
    if long:
        raise BadRequest(f"the input ({long[0]} tokens) is longer than the model's context length ({context} tokens)")
    return_logprob = req.get("return_logprob", False)
    return_logprob = return_logprob if isinstance(return_logprob, list) else [bool(return_logprob)] * n
    start_len = req.get("logprob_start_len", -1)
    start_len = start_len if isinstance(start_len, list) else [start_len] * n
    rids = req.get("rid")
    rids = rids if isinstance(rids, list) else [rids] * n
    top_num, at_ids = _prefill_options(req, n)
    for i, p in enumerate(params):
        if (top_num[i] or at_ids[i]) and (
            p.max_new_tokens > 0 or start_len[i] is None or start_len[i] < 0 or not return_logprob[i]
        ):
            raise BadRequest(
                "megaopd serve returns top_logprobs_num / token_ids_logprob for input (prompt) "
                "positions only: send max_new_tokens=0, return_logprob=true and "
                "logprob_start_len >= 0 (prefill scoring), or use a real SGLang server"
            )
        if return_logprob[i] and start_len[i] is not None and start_len[i] > len(prompts[i]):
            raise BadRequest(
                f"logprob_start_len={start_len[i]} is higher than the number of input tokens "
                f"({len(prompts[i])}). Please use a smaller logprob_start_len."
            )
    return GenerateRequest(prompts, single, params, return_logprob, start_len, rids, top_num, at_ids)


def check_values(p: ParsedParams) -> None:
    """BadRequest naming the field for what SGLang's checks let through: NaN / inf (a NaN temperature
    sampled id 255 of a 128-id vocabulary, an infinite one sampled uniformly) and seeds over 64 bits."""
    for name in ("temperature", "top_p", "min_p"):
        if not math.isfinite(getattr(p, name)):
            raise BadRequest(f"sampling_params.{name}={getattr(p, name)} must be a finite number")
    if p.seed is not None and not -(1 << 63) <= p.seed < (1 << 64):
        raise BadRequest(f"sampling_params.sampling_seed={p.seed} must fit in 64 bits")


def _context(engine: ModelRunner) -> int | None:
    """The model's context length in tokens (None: its config names none)."""
    return getattr(engine.model.config, "max_position_embeddings", None)


def expand(engine: ModelRunner, gen: GenerateRequest) -> list[Entry]:
    """Prompt i's samples as consecutive entries (prompt-major), each a row the runner can run."""
    entries = []
    for s in expand_samples(
        gen.prompts, [p.n for p in gen.params], [p.seed for p in gen.params], keep_single_seeds=True
    ):
        i, p = s.prompt_index, gen.params[s.prompt_index]
        row = row_request(s, p, engine.eos_ids)
        if p.max_new_tokens > 0:
            try:
                engine.check_row(row)
            except ValueError as e:
                raise BadRequest(str(e)) from e
        # The client's rid names the one entry of a one-sample request; otherwise each entry gets its own.
        rid = gen.rids[i] if gen.rids[i] is not None and p.n == 1 and len(gen.prompts) == 1 else None
        entries.append(Entry(i, row, rid or uuid.uuid4().hex))
    return entries


def answer(
    engine: ModelRunner, gen: GenerateRequest, entries: list[Entry], results: list[RowResult], latency: float
) -> Any:
    """The JSON answer; results: one per entry with max_new_tokens > 0, in entry order."""
    it = iter(results)
    out = []
    for e in entries:
        res = next(it) if e.row.max_new_tokens > 0 else RowResult(weight_version=engine.weight_version)
        meta = _meta(e.rid, res, e.row, latency)
        if gen.return_logprob[e.prompt]:
            start = gen.start_len[e.prompt] if gen.start_len[e.prompt] is not None else -1
            meta.update(
                _logprobs_meta(engine, e.row.prompt_ids, res, start, gen.top_num[e.prompt], gen.at_ids[e.prompt])
            )
        out.append({"text": engine.decode(res.output_ids), "output_ids": res.output_ids, "meta_info": meta})
    return out[0] if gen.single and len(out) == 1 else out


def _prompts(engine: ModelRunner, req: dict) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether one came bare."""
    if req.get("text") is not None:
        if engine.tokenizer is None:
            raise BadRequest("this model directory has no tokenizer; send input_ids instead of text")
        text = req["text"]
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a list of strings", kind="schema")
        return [engine.tokenizer(t)["input_ids"] for t in texts], isinstance(text, str)
    ids = req["input_ids"]
    if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
        return [list(ids)], True
    if (
        isinstance(ids, list)
        and ids
        and all(isinstance(p, list) for p in ids)
        and all(_is_int(t) for p in ids for t in p)
    ):
        if any(len(p) == 0 for p in ids):
            raise BadRequest("input_ids has an empty prompt")
        return [list(p) for p in ids], False
    raise BadRequest("input_ids must be a non-empty list of integers or a list of such lists", kind="schema")


def _prefill_options(req: dict, n: int) -> tuple[list[int], list[list[int] | None]]:
    """Per prompt: top_logprobs_num (an int or a list of ints) and token_ids_logprob (one list of ids for
    every prompt, or one list per prompt), validated as SGLang's schema would."""
    top = req.get("top_logprobs_num") or 0
    top = top if isinstance(top, list) else [top] * n
    if len(top) != n or not all(_is_int(k) and k >= 0 for k in top):
        raise BadRequest(
            f"top_logprobs_num must be a non-negative integer (or one per prompt), got {req.get('top_logprobs_num')!r}",
            kind="schema",
        )
    ids = req.get("token_ids_logprob")
    if ids is None or ids == []:
        per = [None] * n
    elif isinstance(ids, list) and all(_is_int(t) for t in ids):
        per = [list(ids)] * n
    elif (
        isinstance(ids, list)
        and len(ids) == n
        and all(x is None or (isinstance(x, list) and all(_is_int(t) for t in x)) for x in ids)
    ):
        per = [list(x) if x else None for x in ids]
    else:
        raise BadRequest("token_ids_logprob must be a list of token ids, or one such list per prompt", kind="schema")
    return [int(k) for k in top], per


def _meta(rid: str, res: RowResult, row: RowRequest, latency: float) -> dict:
    """SGLang 0.5.23's meta_info of one entry, every field it sends (those megaopd has no notion of at their
    neutral values: no retractions, no reasoning parser, no prefix cache, one data-parallel rank)."""
    n = len(res.output_ids)
    return {
        "id": rid,
        "finish_reason": finish_reason_json(res.finish_reason, res.matched, row.max_new_tokens),
        "prompt_tokens": len(row.prompt_ids),
        "completion_tokens": n,
        "cached_tokens": 0,
        "cached_tokens_details": None,
        "weight_version": res.weight_version,
        "weight_versions": [{"version": res.weight_version, "start": 0, "end": n}],
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "dp_rank": None,
        "e2e_latency": latency,
        "response_sent_to_client_ts": time.time(),
    }


def _logprobs_meta(
    engine: ModelRunner, prompt_ids: list[int], res: RowResult, start: int, top_num: int, at_ids: list[int] | None
) -> dict:
    """The log-prob fields of a return_logprob answer, as SGLang 0.5.23 sends them.

    output_token_logprobs: [logprob, id, null] per output token. input_token_logprobs (always present;
    [] for logprob_start_len -1): entry j is about prompt token start + j, and the entry AT start is
    [null, id, null] for every start, since SGLang scores nothing before start (so the token at start has
    no prefix to be scored from). With top_logprobs_num / token_ids_logprob (prefill scoring only, see
    generate): input_top_logprobs / input_token_ids_logprobs with null at start, and output_top_logprobs /
    output_token_ids_logprobs with one entry, the distribution after the prompt (SGLang computes it even
    with max_new_tokens 0). Temperature 1, as SGLang's input log-probs.
    """
    meta = {
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(res.logprobs, res.output_ids)],
        "output_token_logprobs_length": len(res.output_ids),
        "input_token_logprobs": [],
    }
    if start < 0:
        return meta
    if any(not 0 <= int(t) < engine.vocab_size for t in prompt_ids):
        raise BadRequest(f"input_ids has ids outside the vocabulary [0, {engine.vocab_size})")
    if at_ids and any(not 0 <= t < engine.vocab_size for t in at_ids):
        raise BadRequest(f"token_ids_logprob has ids outside the vocabulary [0, {engine.vocab_size})")
    L, n_in = len(prompt_ids), len(prompt_ids) - start  # n_in input entries, about tokens start..L-1
    scores = engine.prompt_scores(prompt_ids, top_num, at_ids, first=min(start + 1, L))
    if n_in:
        meta["input_token_logprobs"] = [[None, prompt_ids[start], None]] + [
            [lp, t, None] for lp, t in zip(scores.logprobs, prompt_ids[start + 1 :])
        ]

    def split(rows_KV):  # distributions predicting tokens start+1..L-1, then the one after the prompt
        return ([None] + rows_KV[: n_in - 1]) if n_in else [], rows_KV[-1:]

    if top_num:
        meta["input_top_logprobs"], meta["output_top_logprobs"] = split(
            [[[lp, t, None] for lp, t in zip(v, i)] for v, i in zip(scores.top_logprobs, scores.top_ids)]
        )
    if at_ids:
        meta["input_token_ids_logprobs"], meta["output_token_ids_logprobs"] = split(
            [[[lp, t, None] for lp, t in zip(v, at_ids)] for v in scores.at_ids_logprobs]
        )
    return meta


def _is_int(x) -> bool:
    """A JSON integer: true and false parse to bools, which Python counts as ints."""
    return isinstance(x, int) and not isinstance(x, bool)
