"""`megaopd serve` trusts nothing handed in: its key, its bind, its request limits, sampling values, the folders
and hosts weight updates may reach, and weights holding NaN. A real server on loopback."""

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from megaopd.engine.config import EmbeddedEngineConfig
from megaopd.rollout.client import EngineRequestError, HttpEngine, HttpEngineConfig
from megaopd.rollout.embedded import EmbeddedEngine
from megaopd.rollout.protocol import SamplingParams
from megaopd.serving.server import RolloutServer, ServeConfig

KEY = "k3y-for-the-tests"
PROMPT = [5, 6, 7]


def call(url, method, path, body=None, key=KEY, raw=None, headers=None, timeout=60):
    """(status, parsed JSON or text) of one call with `key` as its Bearer token (None: no header)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    req = urllib.request.Request(url + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return status, text


def raw_exchange(port, request: bytes, timeout=10.0) -> tuple[bytes, float]:
    """Sends raw bytes, reads until the server closes (or `timeout`); (what came back, seconds it took)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return got, time.monotonic() - t0


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """An extra folder the keyed server may load weights from."""
    return tmp_path_factory.mktemp("weights_root")


@pytest.fixture(scope="module")
def keyed(tiny_dir, root):
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir, max_batch_size=8))
    config = ServeConfig(
        hf_dir=tiny_dir,
        port=0,
        api_key=KEY,
        max_body_bytes=1 << 20,
        socket_timeout_s=1.5,
        allowed_weight_roots=[str(root)],
    )
    srv = RolloutServer(config, engine=engine).start()
    yield srv
    srv.shutdown()


def greedy(url, key=KEY):
    status, out = call(
        url,
        "POST",
        "/generate",
        {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}},
        key=key,
    )
    assert status == 200, out
    return out["output_ids"]


# ------------------------------------------------------------------------------------------------ the key
def test_every_endpoint_but_health_needs_the_key(keyed):
    url = keyed.url
    assert call(url, "GET", "/health", key=None)[0] == 200  # open, as SGLang's (probes carry no secret)
    assert call(url, "GET", "/health_generate", key=None)[0] == 200
    for key in (None, "wrong", KEY + "x", KEY[:-1]):
        assert call(url, "GET", "/get_model_info", key=key) == (401, {"error": "Unauthorized"})
        assert call(url, "POST", "/generate", {"input_ids": PROMPT}, key=key)[0] == 401
        assert call(url, "GET", "/nope", key=key)[0] == 401  # nothing learnt without the key, not even a 404
    assert call(url, "GET", "/get_model_info", key=None, headers={"Authorization": KEY})[0] == 401  # no scheme
    # What changes state is refused without the key, and nothing changes.
    assert call(url, "POST", "/pause_generation", {"mode": "abort"}, key=None)[0] == 401
    assert not keyed.scheduler.pauses.paused
    assert call(url, "POST", "/release_memory_occupation", {"tags": None}, key=None)[0] == 401
    assert call(url, "POST", "/update_weights_from_disk", {"model_path": keyed.config.hf_dir}, key=None)[0] == 401
    assert call(url, "GET", "/health", key=None)[0] == 200  # still loaded
    # With the key (the scheme's case does not matter, as SGLang's check).
    assert call(url, "GET", "/get_model_info")[0] == 200
    assert call(url, "GET", "/get_model_info", key=None, headers={"Authorization": f"bearer {KEY}"})[0] == 200
    assert len(greedy(url)) == 4
    assert KEY not in repr(keyed.config)


def test_the_client_sends_the_key_from_its_variable(keyed, monkeypatch):
    """HttpEngine (the rollout pool's and the served teacher's client) reads the key from the variable the
    config names (rollout.api_key_env / teacher.api_key_env) and sends it; a 401 says which variable."""
    from megaopd.scoring.remote import RemoteTeacher, ServerPolicy

    monkeypatch.setenv("ENGINE_KEY_FOR_TEST", KEY)
    monkeypatch.delenv("MEGAOPD_API_KEY", raising=False)
    client = HttpEngine(HttpEngineConfig(url=keyed.url, api_key_env="ENGINE_KEY_FOR_TEST"))
    assert KEY not in repr(client.config)
    samples = client.generate([PROMPT], SamplingParams(n=2, max_new_tokens=3, seed=1))
    assert len(samples) == 2 and client.health() and client.model_info()["weight_version"] == "default"
    with pytest.raises(EngineRequestError, match=r"HTTP 401.*set \$MEGAOPD_API_KEY to its --api-key"):
        HttpEngine(keyed.url).generate([PROMPT], SamplingParams(max_new_tokens=1))
    monkeypatch.setenv("MEGAOPD_API_KEY", "not-it")
    with pytest.raises(EngineRequestError, match=r"HTTP 401.*key in \$MEGAOPD_API_KEY is not the server's"):
        HttpEngine(keyed.url).model_info()
    # The served teacher's path (prefill scoring) with the key from teacher.api_key_env.
    tokens = torch.tensor([PROMPT + [8, 9, 10]])
    scores = RemoteTeacher("t", [keyed.url], ServerPolicy(api_key_env="ENGINE_KEY_FOR_TEST")).score(
        tokens, torch.tensor([3]), torch.tensor([3]), topk=2
    )
    assert scores.logprobs_BT[0, 2:5].abs().sum() > 0


def test_key_settings_are_checked_before_anything_loads(tiny_dir, monkeypatch, capsys):
    from megaopd.rollout.config import RolloutConfig
    from megaopd.scoring.config import TeacherConfig
    from megaopd.serving import cli
    from megaopd.serving.sglang_launcher import SGLangLaunchConfig, launch_config, sglang_command

    for host in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="without an API key.*MEGAOPD_API_KEY"):
            ServeConfig(hf_dir=tiny_dir, host=host)
    ServeConfig(hf_dir=tiny_dir, host="localhost")
    ServeConfig(hf_dir=tiny_dir, host="0.0.0.0", api_key=KEY)  # a key allows any interface
    for bad in ("", " spaced ", "naïve", "new\nline"):
        with pytest.raises(ValueError, match="printable ASCII"):
            ServeConfig(hf_dir=tiny_dir, api_key=bad)
    # The command line: one line naming the fix, before the model loads (the path is never read).
    monkeypatch.delenv("MEGAOPD_API_KEY", raising=False)
    assert cli.main(["--hf-dir", "/nonexistent", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--api-key" in err and "MEGAOPD_API_KEY" in err
    # SGLang gets the key on its command line (its only way); configs name the variable, never hold the key.
    monkeypatch.setenv("MEGAOPD_API_KEY", KEY)
    cfg = launch_config(RolloutConfig(engine="remote", urls=["http://h:1"]), "/ckpt/hf", python="py")
    assert sglang_command(cfg)[-2:] == ["--api-key", KEY] and KEY not in repr(cfg)
    assert "--api-key" not in sglang_command(SGLangLaunchConfig(model_path="m"))
    assert "--api-key" not in sglang_command(
        launch_config(RolloutConfig(engine="remote", urls=["http://h:1"], api_key_env=""), "m")
    )
    with pytest.raises(ValueError, match="must name an environment variable"):
        RolloutConfig(engine="remote", urls=["http://h:1"], api_key_env="sk-0123 key")
    with pytest.raises(ValueError, match="must name an environment variable"):
        TeacherConfig(engine="remote", urls=["http://h:1"], api_key_env="s3cret!")


# --------------------------------------------------------------------------------------------- the limits
def test_body_limit(keyed):
    """A body over the limit is answered 413 before it is read (the client still reads the answer)."""
    big = json.dumps({"input_ids": [5] * 400_000}).encode()  # 1.2 MB > 1 MiB
    status, out = call(keyed.url, "POST", "/generate", raw=big)
    assert status == 413 and "--max-body-mb" in out["error"]["message"], out
    client = HttpEngine(HttpEngineConfig(url=keyed.url, api_key=KEY, retries=0))
    with pytest.raises(EngineRequestError, match="HTTP 413"):
        client.generate([[5] * 200_000, [6] * 200_000], SamplingParams(max_new_tokens=1))
    # Without the key, the limit is not even disclosed.
    assert call(keyed.url, "POST", "/generate", raw=big, key=None)[0] == 401
    assert len(greedy(keyed.url)) == 4


def test_bad_content_lengths_free_their_thread(keyed):
    """A negative Content-Length answers 400 at once; one larger than what is sent ends with the socket
    timeout (1.5 s here) instead of holding a thread forever."""
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    for length in ("-1", "-99999", "1e3", "12abc", "0x10"):
        got, took = raw_exchange(keyed.port, (head + f"Content-Length: {length}\r\n\r\n").encode())
        assert got.startswith(b"HTTP/1.1 400") and b"Content-Length" in got and took < 3, (length, got, took)
    got, took = raw_exchange(keyed.port, (head + "Content-Length: 1000\r\n\r\n").encode() + b'{"input_ids": ')
    assert got == b"" and took < 6, (got, took)
    got, _ = raw_exchange(keyed.port, (head + "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n").encode())
    assert got.startswith(b"HTTP/1.1 411"), got
    assert len(greedy(keyed.url)) == 4


def test_a_burst_of_connections_is_queued_not_reset(keyed):
    """100 connections at once (the trainer's concurrent requests): each is answered. The stdlib's backlog
    of 5 reset 13-21% of them."""
    n, barrier, results = 100, threading.Barrier(100), []

    def one():
        barrier.wait()
        try:
            got, _ = raw_exchange(keyed.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 30)
            results.append(got.split(b"\r\n", 1)[0])
        except OSError as e:
            results.append(repr(e).encode())

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [b"HTTP/1.1 200 OK"] * n, [r for r in results if r != b"HTTP/1.1 200 OK"][:5]


@pytest.mark.parametrize(
    "raw_value,field",
    [
        ("NaN", "temperature"),
        ("Infinity", "temperature"),
        ("-Infinity", "temperature"),
        ("1e999", "temperature"),
        ("NaN", "top_p"),
        ("NaN", "min_p"),
        ("Infinity", "min_p"),
    ],
)
def test_nonfinite_sampling_values(keyed, raw_value, field):
    """Python's JSON reads NaN / Infinity / 1e999; a NaN temperature sampled id 255 of a 128-id vocabulary."""
    raw = ('{"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "%s": %s}}' % (field, raw_value)).encode()
    status, out = call(keyed.url, "POST", "/generate", raw=raw)
    assert status == 400 and field in json.dumps(out), out


def test_out_of_range_requests(keyed):
    url = keyed.url
    for sp, field in (
        ({"sampling_seed": 2**80}, "sampling_seed"),
        ({"n": 10**9}, "samples"),
        ({"max_new_tokens": 10**30}, "max_new_tokens"),
    ):
        status, out = call(
            url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, **sp}}
        )
        assert status == 400 and field in json.dumps(out), (sp, out)
    # Prefill scoring is bounded by the model's context (512 tokens in the tiny model), as generation is.
    body = {"return_logprob": True, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}}
    status, out = call(url, "POST", "/generate", {**body, "input_ids": [5] * 513})
    assert status == 400 and "context length (512 tokens)" in out["error"]["message"], out
    status, out = call(url, "POST", "/generate", {**body, "input_ids": [5] * 40})
    assert status == 200 and len(out["meta_info"]["input_token_logprobs"]) == 40


# ------------------------------------------------------------------------------------------ weight updates
def test_weights_load_only_from_allowed_folders(keyed, root, tiny_dir, tmp_path):
    """Default: the served model's folder; --allowed-weight-root adds one. `..` and symlinks are resolved."""
    url = keyed.url
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(open(os.path.join(tiny_dir, "model.safetensors"), "rb").read())
    link = root / "link"
    link.symlink_to(outside)
    file_link = root / "one"
    file_link.mkdir()
    (file_link / "model.safetensors").symlink_to(outside / "model.safetensors")
    for path in (
        "../../..",
        f"{root}/../../../..",
        str(outside),
        str(link),
        f"{tiny_dir}/../{outside.name}",
        "/",
        str(file_link),
    ):
        status, out = call(url, "POST", "/update_weights_from_disk", {"model_path": path})
        assert status == 403 and not out["success"] and "--allowed-weight-root" in out["message"], (path, out)
    before = greedy(url)
    ok = root / "ok"
    ok.mkdir()
    (ok / "model.safetensors").write_bytes((outside / "model.safetensors").read_bytes())
    for path in (tiny_dir, str(ok), f"{ok}/../ok"):
        status, out = call(url, "POST", "/update_weights_from_disk", {"model_path": path})
        assert status == 200 and out["success"], (path, out)
    assert greedy(url) == before


def test_weights_with_nan_are_not_loaded(keyed, root, tiny_dir):
    from safetensors.torch import load_file, save_file

    before = greedy(keyed.url)
    for bad in (float("nan"), float("inf")):
        tensors = load_file(os.path.join(tiny_dir, "model.safetensors"))
        tensors["model.norm.weight"][3] = bad
        folder = root / f"bad_{bad}"
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        status, out = call(keyed.url, "POST", "/update_weights_from_disk", {"model_path": str(folder)})
        assert status == 400 and not out["success"], out
        assert "non-finite" in out["message"] and "model.norm.weight" in out["message"], out
    assert greedy(keyed.url) == before  # nothing was loaded


def test_groups_form_only_with_allowed_hosts(keyed):
    """Default: loopback (the trainer on this machine); --allowed-sync-host adds the trainer's rank 0."""
    from megaopd.serving.access import SyncHosts

    body = {"master_port": 29500, "rank_offset": 1, "world_size": 2, "group_name": "g", "backend": "gloo"}
    for address in ("192.0.2.1", "10.0.0.1", "0.0.0.0"):
        t0 = time.monotonic()
        status, out = call(keyed.url, "POST", "/init_weights_update_group", {**body, "master_address": address})
        assert status == 403 and "--allowed-sync-host" in out["message"] and time.monotonic() - t0 < 5, out
    status, out = call(
        keyed.url, "POST", "/init_weights_update_group", {**body, "master_address": "127.0.0.1", "rank_offset": 2}
    )
    assert status == 400 and "rank_offset" in out["error"]["message"], out
    hosts = SyncHosts(["127.0.0.1", "192.0.2.1"])
    assert hosts.check("192.0.2.1") == "192.0.2.1" and hosts.check("localhost") == "127.0.0.1"
    assert hosts.check("127.0.1.1") == "127.0.1.1"  # any loopback address (Debian names the host so)


_TRAINER = """
import sys, torch
from megaopd.rollout.client import HttpEngine
from megaopd.sync.distributed import DistributedUpdateConfig, DistributedWeightUpdater
from safetensors.torch import load_file
weights = load_file(sys.argv[2])
bad = dict(weights)
bad["model.norm.weight"] = weights["model.norm.weight"].clone()
bad["model.norm.weight"][0] = float("nan")
updater = DistributedWeightUpdater([HttpEngine(sys.argv[1])], DistributedUpdateConfig(timeout_s=60))
updater.connect()
try:
    updater.update(bad.items(), weight_version="nan")
    print("LOADED")
except Exception as e:
    print("REFUSED", str(e).replace("\\n", " "), flush=True)
sys.stdin.readline()
updater.update(weights.items(), weight_version="fixed")
print("FIXED")
updater.close()
"""


@pytest.mark.slow
def test_nan_weights_over_the_group_are_refused(tiny_dir, tmp_path):
    """The trainer's weight sync (a gloo group, per-tensor broadcasts received straight into the model)
    against a keyed server, the key from MEGAOPD_API_KEY: NaN weights fail the update, /generate is refused
    until finite weights arrive, then it answers as before."""
    import subprocess
    import sys

    config = ServeConfig(hf_dir=tiny_dir, port=0, api_key=KEY)
    server = RolloutServer(config, engine=EmbeddedEngine(config.engine_config())).start()
    try:
        before = greedy(server.url)
        env = {**os.environ, "MEGAOPD_API_KEY": KEY}
        proc = subprocess.Popen(
            [sys.executable, "-c", _TRAINER, server.url, os.path.join(tiny_dir, "model.safetensors")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        line = proc.stdout.readline()
        assert line.startswith("REFUSED") and "non-finite" in line and "model.norm.weight" in line, line
        # Between the refused update and the fix: generation is refused, naming the tensor.
        status, out = call(server.url, "POST", "/generate", {"input_ids": PROMPT})
        assert status == 400 and "model.norm.weight" in out["error"]["message"], out
        out, err = proc.communicate("\n", timeout=120)
        assert proc.returncode == 0 and "FIXED" in out, err[-3000:]
        assert greedy(server.url) == before
    finally:
        server.shutdown()


@pytest.mark.slow
def test_a_tiny_run_sends_the_key_to_its_keyed_servers(tmp_path, monkeypatch, one_torch_thread):
    """One Stable-OPD step with the rollouts and the teacher on keyed servers (each its own key, named by
    rollout.api_key_env / teacher.api_key_env): generation, the weight sync, the parity probe and the
    teacher's scoring all authenticate; the keys appear nowhere in the run folder."""
    from megaopd.config import load_config
    from megaopd.config.schema import MegaOPDConfig
    from megaopd.parallel.launch import spawn
    from tests.trainer import _workers
    from tests.trainer.test_golden import golden_overrides
    from tests.trainer.tiny_models import ROOT

    tiny = os.path.join(ROOT, "examples", "tiny")
    keys = {"ROLLOUT_KEY_FOR_TEST": "rollout-k3y-0123", "TEACHER_KEY_FOR_TEST": "teacher-k3y-4567"}
    for var, key in keys.items():
        monkeypatch.setenv(var, key)
    servers = []
    try:
        for model, key in (("student", keys["ROLLOUT_KEY_FOR_TEST"]), ("teacher", keys["TEACHER_KEY_FOR_TEST"])):
            config = ServeConfig(hf_dir=os.path.join(tiny, "models", model), port=0, api_key=key)
            servers.append(RolloutServer(config, engine=EmbeddedEngine(config.engine_config())).start())
        run = tmp_path / "run"
        cfg = load_config(
            MegaOPDConfig,
            os.path.join(tiny, "stable_opd.yaml"),
            golden_overrides(str(run))
            + [
                "run.world_size=1",
                "student.tp=1",
                "reference.tp=1",
                "teacher.tp=1",
                "trainer.max_steps=1",
                "trainer.prompts_per_step=4",
                "trainer.micro_batch_size=4",
                "rollout.max_new_tokens=16",
                "rollout.engine=remote",
                f"rollout.urls=[{servers[0].url}]",
                "rollout.api_key_env=ROLLOUT_KEY_FOR_TEST",
                "teacher.engine=remote",
                f"teacher.urls=[{servers[1].url}]",
                "teacher.api_key_env=TEACHER_KEY_FOR_TEST",
            ],
        )
        spawn(_workers.run_presets, 1, args=([cfg],), timeout=600)
    finally:
        for s in servers:
            s.shutdown()
    assert servers[0].engine.weight_version != "default"  # the trainer's weights were pushed to it
    with open(run / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f if '"event"' not in line] == [1]
    for dirpath, _, files in os.walk(run):
        for name in files:
            data = open(os.path.join(dirpath, name), "rb").read()
            assert not any(k.encode() in data for k in keys.values()), os.path.join(dirpath, name)


@pytest.mark.slow
def test_the_command_line_reads_the_key_from_the_environment(tiny_dir, tmp_path):
    """`megaopd serve --host 0.0.0.0` with MEGAOPD_API_KEY set: starts, wants the key, never logs it."""
    from megaopd.parallel.dist import find_free_port
    from megaopd.serving.sglang_launcher import ServerProcess, megaopd_serve_command

    port = find_free_port()
    log = str(tmp_path / "serve.log")
    cmd = megaopd_serve_command(
        tiny_dir, port, host="0.0.0.0", extra_args=["--num-threads", "1", "--log-level", "DEBUG"]
    )
    with ServerProcess.start(
        cmd,
        url=f"http://127.0.0.1:{port}",
        startup_timeout_s=120,
        log_path=log,
        env={"MEGAOPD_API_KEY": KEY},
        die_with_parent=True,
    ) as server:
        assert call(server.url, "GET", "/get_model_info", key=None)[0] == 401
        assert len(greedy(server.url)) == 4
        assert call(server.url, "GET", "/get_model_info", key="wrong")[0] == 401
    text = open(log).read()
    assert "API key required" in text and KEY not in text, text[-2000:]


def test_lora_adapter_loads_only_with_the_key_and_from_allowed_folders(keyed, root, tiny_dir, tmp_path):
    """POST /load_lora_adapter (issue 55): a peft adapter folder merged into the served base, behind the same key,
    allowed roots and finite-value check as /update_weights_from_disk; a zero adapter brings the base back."""
    import json

    import torch
    from safetensors.torch import save_file

    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.weights import hf_shapes

    shapes = hf_shapes(read_hf_config(tiny_dir))
    gen = torch.Generator().manual_seed(3)

    def adapter(folder, scale, poison=False):
        tensors = {}
        for n, shape in shapes.items():
            if n.endswith(("q_proj.weight", "down_proj.weight")):
                rows, cols = shape
                stem = "base_model.model." + n[: -len("weight")]
                tensors[stem + "lora_A.weight"] = torch.randn(4, cols, generator=gen)
                tensors[stem + "lora_B.weight"] = torch.randn(rows, 4, generator=gen) * scale
        if poison:
            next(iter(tensors.values()))[0, 0] = float("nan")
        folder.mkdir()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
        return str(folder)

    url = keyed.url
    before = greedy(url)
    outside = adapter(tmp_path / "outside", 1.0)
    status, out = call(url, "POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": outside})
    assert status == 403 and "--allowed-weight-root" in out["message"], out
    inside = adapter(root / "lora_a", 1.0)
    assert call(url, "POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": inside}, key=None)[0] == 401
    status, out = call(
        url, "POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": adapter(root / "nan", 1.0, True)}
    )
    assert status == 400 and "non-finite" in out["message"], out
    assert greedy(url) == before  # nothing loaded so far
    status, out = call(url, "POST", "/load_lora_adapter", {"lora_name": "lora-step-1", "lora_path": inside})
    assert status == 200 and out["success"], out
    assert greedy(url) != before
    status, out = call(
        url, "POST", "/load_lora_adapter", {"lora_name": "zero", "lora_path": adapter(root / "zero", 0.0)}
    )
    assert status == 200 and greedy(url) == before  # the base plus a zero adapter: the base again


def test_lora_adapter_in_the_request_needs_the_key_and_safetensors(keyed):
    """/load_lora_adapter's other form (the trainer's adapter sync, megaopd.sync.http_lora): the adapter's two files
    in the body, behind the same key and body limit; safetensors bytes only; one form or the other, not both."""
    import base64

    import torch
    from safetensors.torch import save

    from megaopd.sync.http_lora import adapter_request
    from megaopd.sync.transport import AdapterMeta

    url = keyed.url
    before = greedy(url)
    stem = "base_model.model.model.layers.0.self_attn.q_proj."
    q = torch.Generator().manual_seed(5)
    body = adapter_request(
        [(stem + "lora_A.weight", torch.randn(2, 64, generator=q)), (stem + "lora_B.weight", torch.randn(64, 2))],
        AdapterMeta(rank=2, alpha=4.0),
        "lora-1",
    )
    assert call(url, "POST", "/load_lora_adapter", body, key=None)[0] == 401
    status, out = call(url, "POST", "/load_lora_adapter", {**body, "lora_path": "/tmp"})
    assert status == 400 and "not both" in out["error"]["message"], out
    status, out = call(url, "POST", "/load_lora_adapter", {**body, "adapter_model": "not base64!"})
    assert status == 400, out
    pickled = base64.b64encode(b"\x80\x04K\x01.").decode()  # a pickle is not a safetensors file: never unpickled
    status, out = call(url, "POST", "/load_lora_adapter", {**body, "adapter_model": pickled})
    assert status == 400 and "not a safetensors file" in out["message"], out
    nan = {stem + "lora_A.weight": torch.full((2, 64), float("nan")), stem + "lora_B.weight": torch.ones(64, 2)}
    status, out = call(
        url, "POST", "/load_lora_adapter", {**body, "adapter_model": base64.b64encode(save(nan)).decode()}
    )
    assert status == 400 and "non-finite" in out["message"], out
    assert greedy(url) == before  # nothing loaded so far
    status, out = call(url, "POST", "/load_lora_adapter", body)
    assert status == 200 and out["success"], out
    assert greedy(url) != before
    zero = {**body, "lora_name": "zero"}
    zero["adapter_model"] = base64.b64encode(
        save({stem + "lora_A.weight": torch.ones(2, 64), stem + "lora_B.weight": torch.zeros(64, 2)})
    ).decode()
    assert call(url, "POST", "/load_lora_adapter", zero)[0] == 200 and greedy(url) == before
