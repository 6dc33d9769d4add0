"""`megaopd serve` over loopback: SGLang schemas, errors, control endpoints, client, weight updates."""

import json
import urllib.error
import urllib.request

import pytest

from megaopd.engine.config import EmbeddedEngineConfig
from megaopd.rollout.client import EngineRequestError, HttpEngine
from megaopd.rollout.embedded import EmbeddedEngine
from megaopd.rollout.protocol import SamplingParams
from megaopd.serving.server import RolloutServer, ServeConfig
from tests.engine._models import EOS, hf_logprobs
from tests.serving.sglang_cases import (
    DIFFERENCES,
    REFUSALS,
    assert_same_shape,
    call,
    error_kind,
    error_message,
    send_refusal,
)

# --- Answers of a real SGLang 0.5.23 server (CPU, 2026-11) to such requests (ids of the tiny student); ours
# --- must have the same keys and types at every level (sglang_cases.assert_same_shape).
SGLANG_GENERATE_REQUEST = json.loads("""
{"input_ids": [785, 6722, 315, 9625, 374], "sampling_params": {"temperature": 0, "max_new_tokens": 32}}
""")
SGLANG_GENERATE_RESPONSE = json.loads("""
{"text": "r fr both", "output_ids": [87, 5, 75, 87, 5, 200], "meta_info": {"id": "5ec101be62f44aab98628a78e5d51d0e",
 "finish_reason": {"type": "length", "length": 6}, "prompt_tokens": 2, "weight_version": "default",
 "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": 6, "cached_tokens": 0,
 "weight_versions": [{"version": "default", "start": 0, "end": 6}], "cached_tokens_details": null,
 "dp_rank": null, "e2e_latency": 0.25, "response_sent_to_client_ts": 1795571753.0379405}}
""")
SGLANG_LOGPROB_RESPONSE_META = json.loads("""
{"id": "371889315a444d17bb9042e0e06b4cef", "finish_reason": {"type": "length", "length": 3}, "prompt_tokens": 5,
 "weight_version": "default", "num_retractions": 0,
 "input_token_logprobs": [[null, 5, null], [-10.51, 9, null], [-9.25, 17, null]],
 "output_token_logprobs": [[-0.19, 128, null], [-0.08, 128, null], [-0.52, 243, null]],
 "output_token_logprobs_length": 3, "reasoning_tokens": 0, "completion_tokens": 3, "cached_tokens": 0,
 "weight_versions": [{"version": "default", "start": 0, "end": 3}], "cached_tokens_details": null,
 "dp_rank": null, "e2e_latency": 0.25, "response_sent_to_client_ts": 1795571753.0379405}
""")
SGLANG_INIT_GROUP_REQUEST = json.loads("""
{"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
 "group_name": "weight_update_group", "backend": "gloo"}
""")
SGLANG_UPDATE_REQUEST = json.loads("""
{"names": ["model.embed_tokens.weight"], "dtypes": ["float32"], "shapes": [[128, 64]],
 "group_name": "weight_update_group", "flush_cache": true, "weight_version": "v1"}
""")
SGLANG_PAUSE_RESPONSE = json.loads("""{"message": "Generation paused successfully.", "status": "ok"}""")


def post(url, path, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, _json_or_text(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, _json_or_text(e.read().decode())


def _json_or_text(text):
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return text


def get(url, path):
    try:
        with urllib.request.urlopen(url + path, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir, max_batch_size=32))
    # The refusal cases load from fresh pytest folders (SGLang's answer to a folder without weights).
    roots = [str(tmp_path_factory.getbasetemp())]
    srv = RolloutServer(ServeConfig(hf_dir=tiny_dir, port=0, allowed_weight_roots=roots), engine=engine).start()
    yield srv
    srv.shutdown()


def test_generate_matches_sglang_schema(server, tiny_dir):
    req = dict(SGLANG_GENERATE_REQUEST, input_ids=[5, 6, 7, 8, 9])
    status, out = post(server.url, "/generate", req)
    assert status == 200 and isinstance(out, dict)
    assert_same_shape(out, SGLANG_GENERATE_RESPONSE)
    assert set(out["meta_info"]) >= set(SGLANG_GENERATE_RESPONSE["meta_info"])
    assert "output_token_logprobs" not in out["meta_info"]
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == len(out["output_ids"])
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"] == {"type": "length", "length": 32} and len(out["output_ids"]) == 32
    else:
        assert meta["finish_reason"] == {"type": "stop", "matched": EOS} and out["output_ids"][-1] == EOS

    # Logprobs, stop on a stop id, the prompt's log-probs (logprob_start_len=0).
    status, free = post(
        server.url,
        "/generate",
        {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}},
    )
    stop_id = free["output_ids"][2]
    status, out = post(
        server.url,
        "/generate",
        {
            "input_ids": [5, 6, 7],
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "stop_token_ids": [stop_id]},
        },
    )
    assert status == 200
    assert_same_shape(dict(out["meta_info"], finish_reason=None), SGLANG_LOGPROB_RESPONSE_META)  # a stop here
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"][-1] == stop_id
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    ref = hf_logprobs(tiny_dir, [5, 6, 7], out["output_ids"], 1.0)
    assert max(abs(a[0] - b) for a, b in zip(lps, ref.tolist())) < 1e-4
    inp = out["meta_info"]["input_token_logprobs"]
    assert inp[0] == [None, 5, None] and [t for _, t, _ in inp] == [5, 6, 7]
    ref_in = hf_logprobs(tiny_dir, [5], [6, 7], 1.0)
    assert max(abs(a[0] - b) for a, b in zip(inp[1:], ref_in.tolist())) < 1e-4


def test_batch_and_n(server):
    status, out = post(
        server.url,
        "/generate",
        {
            "input_ids": [[5, 6], [7, 8, 9]],
            "return_logprob": True,
            "sampling_params": [
                {"max_new_tokens": 3, "ignore_eos": True, "sampling_seed": 1},
                {"max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 2},
            ],
        },
    )
    assert status == 200 and isinstance(out, list) and len(out) == 2
    assert [len(o["output_ids"]) for o in out] == [3, 5]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 3]
    # n > 1 on one prompt: an array of n entries; with a seed, distinct yet reproducible samples.
    body = {"input_ids": [5, 6], "rid": "abc", "sampling_params": {"n": 4, "max_new_tokens": 6, "sampling_seed": 7}}
    status, a = post(server.url, "/generate", body)
    status, b = post(server.url, "/generate", body)
    assert isinstance(a, list) and len(a) == 4
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert len({tuple(o["output_ids"]) for o in a}) > 1
    status, one = post(
        server.url, "/generate", {"input_ids": [5, 6], "rid": "abc", "sampling_params": {"max_new_tokens": 2}}
    )
    assert one["meta_info"]["id"] == "abc"
    # max_new_tokens 0 (SGLang allows it, for prompt scoring).
    status, zero = post(server.url, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 0}})
    assert status == 200 and zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["length"] == 0


@pytest.mark.parametrize("case", REFUSALS, ids=lambda c: c.name)
def test_refusals_are_sglangs(server, case, tmp_path):
    """Every request SGLang 0.5.23 refuses (tests/serving/sglang_cases.py, checked against SGLang itself in
    tests/e2e/sglang), refused with its status and kind of body."""
    status, out = send_refusal(server.url, case, str(tmp_path))
    assert status == case.status, out
    assert error_kind(status, out) == case.kind, out
    assert case.needle in error_message(out), out


@pytest.mark.parametrize("case", DIFFERENCES, ids=lambda c: c.name)
def test_refusals_where_sglang_differs(server, case):
    """What megaopd serve refuses on purpose where SGLang samples, reinterprets, fails inside or dies."""
    status, out = call(server.url, "POST", case.path, case.body)
    assert status == 400 and error_kind(status, out) in ("value", "schema"), out
    assert case.needle in error_message(out), out


def test_control_endpoints(server):
    assert get(server.url, "/health") == (200, "")
    assert get(server.url, "/health_generate") == (200, "")
    status, text = get(server.url, "/flush_cache")
    assert status == 200 and text.startswith("Cache flushed")
    assert post(server.url, "/flush_cache", {})[0] == 200
    status, info = get(server.url, "/get_model_info")
    info = json.loads(info)
    assert info["model_path"] == server.config.hf_dir and info["weight_version"] == "default"
    assert json.loads(get(server.url, "/get_server_info")[1])["tp_size"] == 1
    status, out = post(server.url, "/pause_generation", {"mode": "in_place"})
    assert status == 200 and out == SGLANG_PAUSE_RESPONSE
    assert post(server.url, "/continue_generation", {})[1]["status"] == "ok"
    assert post(server.url, "/pause_generation", {"mode": "later"})[0] == 400
    assert post(server.url, "/release_memory_occupation", {"tags": ["kv_cache"]}) == (200, None)
    assert get(server.url, "/health")[0] == 503
    status, out = post(server.url, "/generate", {"input_ids": [1, 2]})
    assert status == 400 and "resume_memory" in out["error"]["message"]
    # Resuming a tag that was never released is refused (SGLang 0.5.23 dies on it): null means all tags.
    status, out = post(server.url, "/resume_memory_occupation", {"tags": None})
    assert status == 400 and "not released" in out["error"]["message"] and "weights" in out["error"]["message"]
    assert post(server.url, "/resume_memory_occupation", {"tags": ["kv_cache"]}) == (200, None)
    assert post(server.url, "/release_memory_occupation", {"tags": ["gpu"]})[0] == 400
    assert get(server.url, "/health")[0] == 200


def test_http_engine_equals_embedded_engine(server, tiny_dir):
    client = HttpEngine(server.url)
    local = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir))
    params = SamplingParams(n=3, max_new_tokens=9, temperature=0.9, top_p=0.95, top_k=50, seed=17)
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12]]
    remote, mine = client.generate(prompts, params), local.generate(prompts, params)
    assert [s.output_ids for s in remote] == [s.output_ids for s in mine]
    assert [s.finish_reason for s in remote] == [s.finish_reason for s in mine]
    assert max(abs(a - b) for r, m in zip(remote, mine) for a, b in zip(r.output_logprobs, m.output_logprobs)) < 1e-5
    assert client.health() and client.model_info()["weight_version"] == "default"
    lps = client.prompt_logprobs([5, 6, 7, 8])
    assert lps[0] is None
    assert max(abs(a - b) for a, b in zip(lps[1:], local.prompt_logprobs([5, 6, 7, 8])[1:])) < 1e-5
    with pytest.raises(EngineRequestError, match="vocabulary"):
        client.generate([[1000]], params)


def test_two_prompts_in_one_n_request_get_their_own_seeds(server, tiny_dir):
    """An n > 1 request with two prompts: sample j of prompt i draws derive_seed(seed, i, j). Before the
    one request expansion (rollout/protocol.expand_samples) the server used prompt index 0 for every
    prompt, so identical prompts got identical samples: prompt 1 repeated prompt 0's stream."""
    body = {
        "input_ids": [[5, 6, 7], [5, 6, 7]],
        "return_logprob": True,
        "sampling_params": {"n": 2, "max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True},
    }
    status, out = post(server.url, "/generate", body)
    assert status == 200 and len(out) == 4  # prompt-major: p0s0, p0s1, p1s0, p1s1
    ids = [e["output_ids"] for e in out]
    assert ids[0] != ids[1] and ids[2] != ids[3]  # samples of one prompt differ
    assert ids[0] != ids[2] and ids[1] != ids[3]  # ...and so do the two prompts' streams
    # The same expansion as the embedded engine's (and the client's): equal samples for equal seeds.
    local = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir))
    want = local.generate(
        [[5, 6, 7], [5, 6, 7]], SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    )
    assert ids == [s.output_ids for s in want]


def test_prefill_parsing_reads_sglangs_answers():
    """The client's parsing of prefill scores on answers recorded from SGLang 0.5.23: it asked from
    first - 1, the entry there is null, the last vocabulary id (255 in the tiny student) comes back as 0."""
    from megaopd.rollout.schema import prefill_request, prefill_scores_from_json

    seq = [5, 9, 17, 33, 4]
    body = prefill_request([seq], [3], topk=2)
    assert body["logprob_start_len"] == [2] and body["sampling_params"][0]["max_new_tokens"] == 0
    answer = {
        "meta_info": {  # SGLang 0.5.23, logprob_start_len 2, top_logprobs_num 2 (cut from 3)
            "input_token_logprobs": [[None, 17, None], [-8.874113082885742, 33, None], [-10.857186317443848, 4, None]],
            "input_top_logprobs": [
                None,
                [[-0.14435583353042603, 196, None], [-3.968883991241455, 254, None]],
                [[-1.2047711610794067, 196, None], [-1.310813069343567, 254, None]],
            ],
        }
    }
    scores = prefill_scores_from_json(answer, seq, 3, topk=2)
    assert scores.logprobs == [-8.874113082885742, -10.857186317443848]
    assert scores.top_ids == [[196, 254], [196, 254]]
    last = {
        "meta_info": {
            "input_token_logprobs": [[None, 5, None], [-9.52465534210205, 0, None], [-1.6511369943618774, 150, None]]
        }
    }
    assert prefill_scores_from_json(last, [5, 255, 150], 1).logprobs == [-9.52465534210205, -1.6511369943618774]
    with pytest.raises(ValueError, match="at token 2 of 3, sent \\[150\\], answered \\[151\\]"):
        prefill_scores_from_json(
            {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.0, 255, None], [-1.0, 151, None]]}},
            [5, 255, 150],
            1,
        )
    with pytest.raises(ValueError, match="3 entries for the 1 tokens scored"):  # an answer from another start
        prefill_scores_from_json(last, [5, 255, 150], 2)
    with pytest.raises(ValueError, match="first positions"):
        prefill_request([seq], [0])


def _answer(lps, tops=None):
    meta = {"input_token_logprobs": [[None, 17, None]] + [[lp, t, None] for lp, t in zip(lps, [33, 4])]}
    if tops is not None:
        meta["input_top_logprobs"] = [None] + [[[lp, i, None] for lp, i in t] for t in tops]
    return {"meta_info": meta}


@pytest.mark.parametrize(
    "lps,tops,error",
    [
        ([3.0, -1.0], None, "input_token_logprobs at token 3 is 3.0: a log-prob must be finite and <= 0"),
        ([-1.0, float("nan")], None, "input_token_logprobs at token 4 is nan"),
        ([-1.0, float("-inf")], None, "input_token_logprobs at token 4 is -inf"),
        ([-1.0, "x"], None, "input_token_logprobs at token 4 is 'x', not a number"),
        (
            [-1.0, -2.0],
            [[(-0.1, 196), (0.5, 254)], [(-1.2, 196), (-1.3, 254)]],
            "input_top_logprobs at token 3, rank 1 is 0.5",
        ),
        ([-1.0, -2.0], [[(-0.1, 196), (-0.2, 254)], [(-1.3, 196), (-1.2, 254)]], "at token 4 is not sorted"),
        (
            [-1.0, -2.0],
            [[(-0.1, 196), (None, 254)], [(-1.2, 196), (-1.3, 254)]],
            "at token 3, rank 1 is None, not a number",
        ),
    ],
)
def test_served_scores_are_checked_at_the_door_naming_the_server_and_the_row(lps, tops, error):
    """Issue 53: a served teacher answering +3.0 (through a proxy) or NaN trained the student on it."""
    from megaopd.rollout.schema import prefill_scores_list

    seq = [5, 9, 17, 33, 4]
    good = _answer([-1.0, -2.0], [[(-0.1, 196), (-0.2, 254)], [(-1.2, 196), (-1.3, 254)]] if tops else None)
    with pytest.raises(ValueError) as e:
        prefill_scores_list([good, _answer(lps, tops)], [seq, seq], [3, 3], topk=2 if tops else 0)
    assert str(e.value).startswith("row 1 of 2: ") and error in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert prefill_scores_list([good], [seq], [3], topk=2 if tops else 0)[0].logprobs == [-1.0, -2.0]
    # rounding above 0 passes (a probability of 1 in low precision)
    assert prefill_scores_list([_answer([5e-5, -2.0])], [seq], [3])[0].logprobs == [5e-5, -2.0]


def test_served_scores_of_a_server_are_refused_in_one_line_naming_it(monkeypatch):
    from megaopd.rollout.client import EngineError, HttpEngine

    engine = HttpEngine("http://teacher:30000")  # no request is sent: `request` answers as a proxy would
    monkeypatch.setattr(HttpEngine, "request", lambda self, *a, **k: [_answer([3.0, -1.0])])
    with pytest.raises(
        EngineError, match=r"^http://teacher:30000/generate: row 0 of 1: input_token_logprobs at token 3"
    ):
        engine.score_prefill([[5, 9, 17, 33, 4]], [3])


def test_rollout_log_probs_are_checked_at_the_door():
    from megaopd.rollout.schema import sample_from_json

    entry = {
        "output_ids": [7, 8],
        "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 7, None], [2.5, 8, None]]},
    }
    with pytest.raises(ValueError, match="output_token_logprobs at token 1 is 2.5"):
        sample_from_json([1, 2], entry)


def test_rollout_ids_outside_the_students_vocabulary_are_one_line_naming_the_engine(monkeypatch):
    """Issue 53: an engine returning ids past the vocabulary ended in a bare 'IndexError: index out of range in
    self' deep in the scoring."""
    from megaopd.rollout.client import EngineError, HttpEngine, HttpEngineConfig
    from megaopd.rollout.protocol import SamplingParams

    entry = {
        "output_ids": [7, 300],
        "meta_info": {
            "finish_reason": {"type": "length"},
            "output_token_logprobs": [[-0.5, 7, None], [-1.0, 300, None]],
        },
    }
    engine = HttpEngine(HttpEngineConfig(url="http://rollout:30000", name="rollout.urls[0]", vocab_size=256))
    monkeypatch.setattr(HttpEngine, "request", lambda self, *a, **k: [entry])
    with pytest.raises(EngineError) as e:
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert str(e.value) == (
        "http://rollout:30000/generate (rollout.urls[0]): output_ids [300] lie outside the student's vocabulary "
        "[0, 256): the engine serves another model or tokenizer; point it at the student's (rollout.urls)"
    )
    engine.config.vocab_size = 0  # not known: not checked
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].output_ids == [7, 300]


def test_a_remote_rollout_engine_knows_the_students_vocabulary():
    from megaopd.rollout.build import build_engine
    from megaopd.rollout.config import RolloutConfig
    from tests.trainer.tiny_models import ROOT

    pool = build_engine(RolloutConfig(engine="remote", urls=["http://a:1"]), f"{ROOT}/examples/tiny/models/student")
    assert [e.config.vocab_size for e in pool.engines] == [256]
