"""`megaopd eval --engines` through the trainer's EnginePool, and resumable generations.jsonl.

Fast: the pool over two in-process `megaopd serve` servers gives the same generations and table as the
embedded engine at the same seeds (temperature 0.6); an evaluation interrupted after some engine calls
and started again generates exactly the missing samples and gives the uninterrupted run's table; a torn
last line is cut off; other settings in the same folder are refused.
Slow: the CLI against two `megaopd serve` processes vs the embedded CLI; SIGKILL halfway and restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from megaopd.eval import EvalConfig, EvalModel, evaluate
from megaopd.eval.engines import engine_pool, parse_urls
from megaopd.eval.generations import GenerationStore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUDENT = os.path.join(ROOT, "examples", "tiny", "models", "student")
VAL = os.path.join(ROOT, "examples", "tiny", "data", "val.jsonl")


@pytest.fixture(scope="module")
def tok():
    from megaopd.models.hf_io import load_tokenizer

    return load_tokenizer(STUDENT)


@pytest.fixture(scope="module")
def embedded():
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(EmbeddedEngineConfig(hf_dir=STUDENT, max_batch_size=16))


@pytest.fixture(scope="module")
def two_servers():
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.serving.server import RolloutServer, ServeConfig

    servers = [
        RolloutServer(
            ServeConfig(hf_dir=STUDENT, port=0),
            engine=EmbeddedEngine(EmbeddedEngineConfig(hf_dir=STUDENT, max_batch_size=16)),
        ).start()
        for _ in range(2)
    ]
    yield [s.url for s in servers]
    for s in servers:
        s.shutdown()


def lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


CFG = dict(samples=2, max_new_tokens=64, limit=10, temperature=0.6, seed=3)


def test_pool_of_two_servers_equals_embedded(tok, embedded, two_servers, tmp_path):
    ref = evaluate(EvalModel(embedded, tok, "s"), [VAL], EvalConfig(batch_size=8, **CFG), out_dir=str(tmp_path / "emb"))
    pool = engine_pool(",".join(two_servers))
    got = evaluate(EvalModel(pool, tok, "s"), [VAL], EvalConfig(batch_size=12, **CFG), out_dir=str(tmp_path / "pool"))
    assert (tmp_path / "emb" / "results.md").read_text() == (tmp_path / "pool" / "results.md").read_text()
    assert lines(tmp_path / "emb" / "generations.jsonl") == lines(tmp_path / "pool" / "generations.jsonl")
    assert got.benchmarks[0].accuracy == ref.benchmarks[0].accuracy > 0  # the tiny student solves some
    assert all(pool.engines[i].health() for i in range(2)) and not pool.failed


class Interrupting:
    """Passes calls to `inner`, counting the sequences; raises KeyboardInterrupt on call `stop_at`."""

    def __init__(self, inner, stop_at=None):
        self.inner, self.stop_at, self.calls, self.units = inner, stop_at, 0, []

    def generate(self, prompts, params, first_prompt_index=0):
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        self.units += range(first_prompt_index, first_prompt_index + len(prompts))
        return self.inner.generate(prompts, params, first_prompt_index)


def test_interrupted_evaluation_resumes_with_the_same_table(tok, embedded, tmp_path):
    cfg = EvalConfig(batch_size=6, **CFG)  # 20 samples: calls of 6, 6, 6, 2
    full = evaluate(EvalModel(embedded, tok, "s"), [VAL], cfg, out_dir=str(tmp_path / "full"))
    first = Interrupting(embedded, stop_at=3)
    with pytest.raises(KeyboardInterrupt):
        evaluate(EvalModel(first, tok, "s"), [VAL], cfg, out_dir=str(tmp_path / "run"))
    assert len(lines(tmp_path / "run" / "generations.jsonl")) == 12
    # Restart with another batching: only the 8 missing samples are generated, the table is the same.
    second = Interrupting(embedded)
    again = evaluate(EvalModel(second, tok, "s"), [VAL], EvalConfig(batch_size=5, **CFG), out_dir=str(tmp_path / "run"))
    assert second.units == list(range(12, 20))
    assert (tmp_path / "run" / "results.md").read_text() == (tmp_path / "full" / "results.md").read_text()
    assert again.benchmarks[0].accuracy == full.benchmarks[0].accuracy
    recs = lines(tmp_path / "run" / "generations.jsonl")
    assert Counter((r["index"], r["sample"]) for r in recs) == Counter({(i, j): 1 for i in range(10) for j in range(2)})
    key = lambda r: (r["index"], r["sample"])  # noqa: E731
    assert sorted(recs, key=key) == sorted(lines(tmp_path / "full" / "generations.jsonl"), key=key)
    # A third start has nothing left to generate.
    third = Interrupting(embedded)
    evaluate(EvalModel(third, tok, "s"), [VAL], cfg, out_dir=str(tmp_path / "run"))
    assert third.calls == 0


def test_torn_last_line_is_cut_and_regenerated(tok, embedded, tmp_path):
    cfg = EvalConfig(batch_size=4, **{**CFG, "limit": 3})
    evaluate(EvalModel(embedded, tok, "s"), [VAL], cfg, out_dir=str(tmp_path))
    path = tmp_path / "generations.jsonl"
    full = path.read_text()
    path.write_text(full[: len(full) - 40])  # killed in the middle of the last record
    eng = Interrupting(embedded)
    evaluate(EvalModel(eng, tok, "s"), [VAL], cfg, out_dir=str(tmp_path))
    assert eng.units == [5]
    assert [json.loads(x) for x in path.read_text().splitlines()] == [json.loads(x) for x in full.splitlines()]


def test_other_settings_in_the_same_folder_are_refused(tok, embedded, tmp_path):
    evaluate(EvalModel(embedded, tok), [VAL], EvalConfig(batch_size=4, **{**CFG, "limit": 1}), out_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"temperature: 0.6 -> 1.0.*another --out folder"):
        evaluate(
            EvalModel(embedded, tok),
            [VAL],
            EvalConfig(batch_size=4, **{**CFG, "limit": 1, "temperature": 1.0}),
            out_dir=str(tmp_path),
        )
    with pytest.raises(ValueError, match="2 samples"):  # k is part of every sample's seed
        evaluate(
            EvalModel(embedded, tok),
            [VAL],
            EvalConfig(batch_size=4, **{**CFG, "limit": 1, "samples": 3}),
            out_dir=str(tmp_path),
        )
    # A different --limit is the same evaluation: more problems extend it.
    store = GenerationStore(
        str(tmp_path), {"temperature": 0.6, "top_p": 1.0, "max_new_tokens": 64, "seed": 3, "use_chat_template": True}
    )
    assert len(store.done("val")) == 2
    store.close()


def test_parse_urls_errors():
    assert parse_urls("http://a:1, http://b:2/") == ["http://a:1", "http://b:2"]
    for bad, msg in (("", "empty"), ("a:1", "not a URL"), ("http://a:1,http://a:1", "twice")):
        with pytest.raises(ValueError, match=msg):
            parse_urls(bad)
    with pytest.raises(RuntimeError, match=r"http://127.0.0.1:9/health"):
        engine_pool("http://127.0.0.1:9", wait_s=0)


# ------------------------------------------------------------------------------------------------------
# Slow: the command line against `megaopd serve` processes
# ------------------------------------------------------------------------------------------------------
def _env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def _free_port():
    from megaopd.parallel.dist import find_free_port

    return find_free_port()


@pytest.fixture(scope="module")
def served_processes():
    ports = [_free_port(), _free_port()]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "megaopd.cli", "serve", "--hf-dir", STUDENT, "--port", str(p), "--num-threads", "1"],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    yield [f"http://127.0.0.1:{p}" for p in ports]
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=30)


def _eval_cmd(out, *extra):
    return [
        sys.executable,
        "-m",
        "megaopd.cli",
        "eval",
        "--ckpt",
        STUDENT,
        "--benchmarks",
        VAL,
        "--limit",
        "24",
        "--samples",
        "2",
        "--max-new-tokens",
        "64",
        "--out",
        str(out),
        "--label",
        "student",
        *extra,
    ]


@pytest.mark.slow
def test_cli_engines_equals_embedded_and_kill_restart(served_processes, tmp_path):
    emb = subprocess.run(
        _eval_cmd(tmp_path / "emb", "--batch-size", "8"), env=_env(), capture_output=True, text=True, timeout=600
    )
    assert emb.returncode == 0, emb.stderr
    urls = ",".join(served_processes)
    # --engines, killed (SIGKILL, no clean-up) once at least a third of the samples are on disk.
    out = tmp_path / "pool"
    proc = subprocess.Popen(
        _eval_cmd(out, "--engines", urls, "--engine-wait", "120", "--batch-size", "4"),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    gens = out / "generations.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if gens.exists() and gens.read_text().count("\n") >= 16:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be killed: " + proc.stderr.read()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = gens.read_text().count("\n")
    assert 16 <= killed_at < 48
    r = subprocess.run(
        _eval_cmd(out, "--engines", urls, "--engine-wait", "120"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert (out / "results.md").read_text() == (tmp_path / "emb" / "results.md").read_text()
    assert "| student |" in r.stdout
    recs = lines(gens)
    keys = [(x["index"], x["sample"]) for x in recs]
    assert len(keys) == len(set(keys)) == 48  # every sample once: nothing generated twice
    key = lambda x: (x["index"], x["sample"])  # noqa: E731
    assert sorted(recs, key=key) == sorted(lines(tmp_path / "emb" / "generations.jsonl"), key=key)
