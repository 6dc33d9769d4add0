"""What SGLang 0.5.23's server answers, as requests and expected answers both servers are held to.

Read from a real 0.5.23 server on this CPU (scripts/install_sglang.sh, 2026-11). tests/serving/test_server.py
checks `megaopd serve` against these in the quick tier; tests/e2e/sglang/test_conformance.py sends the same
requests to `megaopd serve` and to SGLang itself, so a fact here that SGLang stops answering fails there.

Bodies use token ids of the tiny models (vocabulary >= 128); `{tmp}` in a path is a fresh empty folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Refusal:
    """A request both servers refuse with the same status and the same kind of body."""

    name: str
    path: str
    body: object
    kind: str
    """SGLang's body: "value" {"error": {"message"}}, "schema" {"object": "error", ..., "code": 400},
    "text" {"error": "<text>"} (a sampling_params field, checked by a strict decoder), "success"
    {"success": false, "message"}, "detail" {"detail"} (a route or method that does not exist)."""
    needle: str
    """A piece of the message both servers' answers contain."""
    status: int = 400
    method: str = "POST"
    raw: bytes | None = None
    """Send these bytes instead of the JSON of `body` (malformed JSON)."""
    session: bool = False
    """Send it inside a weight-update session (begin before, end after)."""


def _gen(**kw):
    return {"input_ids": [5, 6], **kw}


REFUSALS = [
    Refusal("no_input", "/generate", {"sampling_params": {"max_new_tokens": 2}}, "value", "input_ids"),
    Refusal("top_p_zero", "/generate", _gen(sampling_params={"top_p": 0.0}), "value", "top_p"),
    Refusal("top_k_zero", "/generate", _gen(sampling_params={"top_k": 0}), "value", "top_k"),
    Refusal("negative_temperature", "/generate", _gen(sampling_params={"temperature": -1}), "value", "temperature"),
    Refusal(
        "negative_max_new_tokens", "/generate", _gen(sampling_params={"max_new_tokens": -1}), "value", "max_new_tokens"
    ),
    Refusal("min_p_above_one", "/generate", _gen(sampling_params={"min_p": 2}), "value", "min_p"),
    Refusal("longer_than_context", "/generate", _gen(sampling_params={"max_new_tokens": 100000}), "value", "512"),
    Refusal(
        "logprob_start_past_prompt",
        "/generate",
        _gen(return_logprob=True, logprob_start_len=5),
        "value",
        "logprob_start_len",
    ),
    Refusal("input_ids_text", "/generate", {"input_ids": "5 6"}, "schema", "input_ids"),
    Refusal(
        "max_new_tokens_string", "/generate", _gen(sampling_params={"max_new_tokens": "8"}), "text", "invalid type"
    ),
    Refusal("unknown_sampling_param", "/generate", _gen(sampling_params={"bogus": 1}), "text", "bogus"),
    Refusal(
        "stop_token_ids_string", "/generate", _gen(sampling_params={"stop_token_ids": "x"}), "text", "invalid type"
    ),
    Refusal("malformed_json", "/generate", None, "schema", "JSON decode error", raw=b"{not json"),
    Refusal("get_generate", "/generate", None, "detail", "Method Not Allowed", status=405, method="GET"),
    Refusal("unknown_route", "/nope", None, "detail", "Not Found", status=404, method="GET"),
    Refusal(
        "update_outside_session",
        "/update_weights_from_distributed",
        {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "none"},
        "success",
        "begin_weight_update",
    ),
    Refusal(
        "update_unknown_group",
        "/update_weights_from_distributed",
        {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "none"},
        "success",
        "init_weights_update_group",
        session=True,
    ),
    Refusal(
        "update_missing_fields",
        "/update_weights_from_distributed",
        {"names": ["model.norm.weight"]},
        "schema",
        "dtypes",
    ),
    Refusal(
        "init_group_missing_fields",
        "/init_weights_update_group",
        {"master_address": "127.0.0.1"},
        "schema",
        "master_port",
    ),
    Refusal("begin_twice", "/begin_weight_update", {"selector": "all"}, "success", "already open", session=True),
    Refusal("end_without_session", "/end_weight_update", {}, "success", "begin_weight_update"),
    Refusal(
        "begin_bad_selector",
        "/begin_weight_update",
        {"selector": "bogus"},
        "schema",
        "Input should be 'target', 'draft' or 'all'",
    ),
    Refusal(
        "tensor_payload_not_base64",
        "/update_weights_from_tensor",
        {"serialized_named_tensors": ["not base64!"], "load_format": None, "flush_cache": True},
        "schema",
        "base64",
    ),
    Refusal(
        "destroy_unknown_group", "/destroy_weights_update_group", {"group_name": "nope"}, "success", "does not exist"
    ),
    Refusal(
        "disk_without_weights",
        "/update_weights_from_disk",
        {"model_path": "{tmp}"},
        "success",
        "Cannot find any model weights",
    ),
    Refusal("pause_bad_mode", "/pause_generation", {"mode": "later"}, "schema", "Input should be"),
]


@dataclass(frozen=True)
class Difference:
    """A request `megaopd serve` refuses (HTTP 400, value body) where SGLang 0.5.23 does something else.

    Deliberate: megaopd serve implements a subset and refuses the rest instead of sampling differently, and
    it refuses requests SGLang silently reinterprets or dies on. docs/engines.md lists them."""

    name: str
    body: dict
    needle: str
    sglang_status: int | None
    """What SGLang answers (200, 500); None: SGLang's server dies on it, so the conformance suite never
    sends it there (`reason` says why)."""
    reason: str
    path: str = "/generate"
    extra: dict = field(default_factory=dict)


DIFFERENCES = [
    Difference(
        "repetition_penalty",
        _gen(sampling_params={"repetition_penalty": 1.1, "max_new_tokens": 2}),
        "repetition_penalty",
        200,
        "a penalty megaopd serve does not implement (refused, not ignored)",
    ),
    Difference(
        "stop_strings",
        _gen(sampling_params={"stop": ["x"], "max_new_tokens": 2}),
        "stop",
        200,
        "stop strings: megaopd serve stops on token ids only",
    ),
    Difference(
        "stream",
        _gen(stream=True, sampling_params={"max_new_tokens": 2}),
        "stream",
        200,
        "streaming: megaopd serve answers whole responses only",
    ),
    Difference(
        "n_zero",
        _gen(sampling_params={"n": 0, "max_new_tokens": 2}),
        "n must be",
        200,
        "SGLang samples one response for n=0",
    ),
    Difference(
        "text_and_input_ids",
        _gen(text="hi", sampling_params={"max_new_tokens": 2}),
        "exactly one",
        200,
        "SGLang silently uses input_ids when text is given too",
    ),
    Difference(
        "negative_top_logprobs_num",
        _gen(return_logprob=True, top_logprobs_num=-1, sampling_params={"max_new_tokens": 2}),
        "top_logprobs_num",
        200,
        "SGLang ignores a negative top_logprobs_num",
    ),
    Difference(
        "sampling_params_list_too_short",
        {"input_ids": [[5], [6]], "sampling_params": [{}]},
        "list of 1 for 2",
        500,
        "SGLang fails inside (HTTP 500, a retryable status for clients)",
    ),
    Difference(
        "id_outside_vocabulary",
        _gen(input_ids=[5, 100000], sampling_params={"max_new_tokens": 2}),
        "vocabulary",
        None,
        "SGLang 0.5.23 on a CPU: IndexError in the embedding kills the scheduler and "
        "the server exits (megaopd's token ids always come from the model's tokenizer)",
    ),
    Difference(
        "resume_unreleased_tag",
        {"tags": ["weights"]},
        "not released",
        None,
        "SGLang 0.5.23 raises KeyError in the scheduler and the server exits; megaopd's clients refuse "
        "this before sending it",
        path="/resume_memory_occupation",
    ),
]

# meta_info of SGLang 0.5.23's /generate answers, by what the request asked for: every key, both servers.
META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cached_tokens_details",
    "weight_version",
    "weight_versions",
    "num_retractions",
    "reasoning_tokens",
    "dp_rank",
    "e2e_latency",
    "response_sent_to_client_ts",
}
LOGPROB_KEYS = {"output_token_logprobs", "output_token_logprobs_length", "input_token_logprobs"}
TOP_KEYS = {"input_top_logprobs", "output_top_logprobs"}
IDS_KEYS = {"input_token_ids_logprobs", "output_token_ids_logprobs"}


def skeleton(x):
    """The JSON's structure: dict keys -> skeletons, lists -> the skeleton of their first non-null item,
    numbers -> "number", null -> None (compatible with anything: SGLang leaves optional fields null)."""
    if isinstance(x, dict):
        return {k: skeleton(v) for k, v in x.items()}
    if isinstance(x, list):
        items = [i for i in x if i is not None]
        return [skeleton(items[0])] if items else []
    if x is None:
        return None
    if isinstance(x, bool):
        return "bool"
    return "number" if isinstance(x, (int, float)) else type(x).__name__


def assert_same_shape(ours, theirs, path="$"):
    """The same keys at every level and the same types (null matches anything; an empty list matches any list)."""
    a, b = skeleton(ours), skeleton(theirs)
    if a is None or b is None:
        return
    if isinstance(b, dict):
        assert isinstance(a, dict), f"{path}: {a} is not an object"
        assert set(ours) == set(theirs), (
            f"{path}: keys differ: only ours {sorted(set(ours) - set(theirs))}, "
            f"only theirs {sorted(set(theirs) - set(ours))}"
        )
        for k in theirs:
            assert_same_shape(ours[k], theirs[k], f"{path}.{k}")
    elif isinstance(b, list):
        assert isinstance(a, list), f"{path}: {a} is not a list"
        x = [i for i in ours if i is not None]
        y = [i for i in theirs if i is not None]
        if x and y:
            if isinstance(x[0], list) and isinstance(y[0], list) and x[0] and not isinstance(y[0][0], list):
                assert len(x[0]) == len(y[0]), f"{path}[0] has {len(x[0])} items, SGLang's {len(y[0])}"
            assert_same_shape(x[0], y[0], f"{path}[0]")
    else:
        assert a == b, f"{path}: {a} != {b}"


def error_kind(status: int, body) -> str:
    """Which of SGLang's error bodies `body` is (see Refusal.kind)."""
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict) and "message" in body["error"]:
            return "value"
        if isinstance(body.get("error"), str):
            return "text"
        if body.get("object") == "error" and body.get("code") == status:
            return "schema"
        if body.get("success") is False and "message" in body:
            return "success"
        if "detail" in body:
            return "detail"
    return f"unknown body {str(body)[:200]!r}"


def error_message(body) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message"))
        if isinstance(err, str):
            return err
        return str(body.get("message", body.get("detail")))
    return str(body)


def call(url: str, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 120):
    """(status, parsed JSON or text) of one HTTP call, errors included."""
    import json
    import urllib.error
    import urllib.request

    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return status, text


def send_refusal(url: str, case: Refusal, tmp: str):
    """Sends `case` (inside a weight-update session when it says so); returns (status, body)."""
    import json

    body = json.loads(json.dumps(case.body).replace("{tmp}", tmp)) if case.body is not None else None
    if case.session:
        assert call(url, "POST", "/begin_weight_update", {"selector": "all"})[0] == 200
    try:
        return call(url, case.method, case.path, body, raw=case.raw)
    finally:
        if case.session:
            call(url, "POST", "/end_weight_update", {})
