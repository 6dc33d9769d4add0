"""Evaluation throughput of `evaluate()`: problems/s on the embedded engine at generate batch 1 vs 64, and
through the trainer's EnginePool (`megaopd eval --engines`) over 1 and 2 `megaopd serve` processes.

What is timed: evaluate(EvalModel(engine, tokenizer), [bench], EvalConfig(samples=1, batch_size=B)) end to end on the
first N problems of examples/tiny/data/val.jsonl, split into generation (engine.generate) and the rest
(prompt rendering, decoding, math-verify scoring, repetition test, writing generations.jsonl).
    problems/s = N / wall time;  generated tokens/s = sum of response lengths / generation time.
Models: random Qwen2 built here with the tiny tokenizer (256 ids); random weights rarely emit EOS, so
nearly every response runs to max_new_tokens: a fixed amount of work per problem.

Pool modes (--servers 1,2): the servers are started here (`megaopd serve --num-threads 1`, one process
each) and every call of `batch` sequences is split evenly between them; the served model is the same.

    python benchmarks/eval.py                       # tiny + small, N = 64, 64 new tokens, 1 torch thread
    python benchmarks/eval.py --models small --problems 128 --max-new-tokens 128 --threads 2
    python benchmarks/eval.py --models small --batches 64 --servers 1,2     # embedded vs pool of 1 and 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

MODELS = {
    # name: Qwen2Config overrides (vocab = the tiny tokenizer's 256 ids)
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "small": dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2
    ),
}
TOKENIZER_DIR = os.path.join(ROOT, "examples", "tiny", "tokenizer")
VAL_FILE = os.path.join(ROOT, "examples", "tiny", "data", "val.jsonl")


def build_model(name: str, out_dir: str) -> str:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        **MODELS[name],
    )
    Qwen2ForCausalLM(cfg).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


class TimedEngine:
    """Forwards to an engine and adds up the time spent in generate and the tokens it returned."""

    def __init__(self, engine):
        self.engine, self.seconds, self.tokens = engine, 0.0, 0

    def generate(self, prompts, params, first_prompt_index=0):
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, params, first_prompt_index=first_prompt_index)
        self.seconds += time.perf_counter() - t0
        self.tokens += sum(len(s.output_ids) for s in out)
        return out


def start_servers(hf_dir: str, n: int, max_batch: int) -> tuple[list, list[str]]:
    import subprocess

    from megaopd.eval.engines import engine_pool
    from megaopd.parallel.dist import find_free_port

    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    ports = [find_free_port() for _ in range(n)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megaopd.cli",
                "serve",
                "--hf-dir",
                hf_dir,
                "--port",
                str(p),
                "--num-threads",
                "1",
                "--max-batch-size",
                str(max_batch),
                "--log-level",
                "WARNING",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    engine_pool(urls, wait_s=300)  # waits until every server answers /health
    return procs, urls


def run(model: str, batch: int, n_problems: int, max_new_tokens: int, workdir: str, servers: int = 0) -> dict:
    """servers = 0: the embedded engine in this process; k > 0: an EnginePool over k `megaopd serve`."""
    from transformers import AutoTokenizer

    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.eval.benchmarks import Benchmark, Problem, convert_rows, read_rows
    from megaopd.rollout.embedded import EmbeddedEngine

    hf_dir = os.path.join(workdir, model)
    if not os.path.isdir(hf_dir):
        build_model(model, hf_dir)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    rows = convert_rows(read_rows(VAL_FILE)[:n_problems], "tiny_val")
    bench = Benchmark("tiny_val", [Problem(r["id"], r["problem"], r["answer"]) for r in rows], samples=1)
    procs = []
    if servers:
        from megaopd.eval.engines import engine_pool

        procs, urls = start_servers(hf_dir, servers, max(batch, 1))
        engine = TimedEngine(engine_pool(urls))
    else:
        engine = TimedEngine(EmbeddedEngine(EmbeddedEngineConfig(hf_dir=hf_dir, max_batch_size=max(batch, 1))))
    try:
        return _timed(engine, tok, bench, model, batch, max_new_tokens, workdir, servers)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)


def _timed(engine, tok, bench, model, batch, max_new_tokens, workdir, servers) -> dict:
    from megaopd.eval import EvalConfig, EvalModel, evaluate
    from megaopd.eval.benchmarks import Benchmark

    cfg = EvalConfig(samples=1, batch_size=batch, max_new_tokens=max_new_tokens, temperature=0.6)
    # Warm-up (first-call allocations, math-verify import) outside the timing.
    evaluate(
        EvalModel(engine, tok),
        [Benchmark("warm", bench.problems[:2], 1)],
        EvalConfig(samples=1, batch_size=2, max_new_tokens=4),
    )
    engine.seconds, engine.tokens = 0.0, 0
    t0 = time.perf_counter()
    res = evaluate(
        EvalModel(engine, tok), [bench], cfg, out_dir=os.path.join(workdir, f"out_{model}_{batch}_{servers}")
    )
    wall = time.perf_counter() - t0
    b = res.benchmarks[0]
    return {
        "model": model,
        "engine": f"pool of {servers} server(s)" if servers else "embedded",
        "batch": batch,
        "problems": b.n_problems,
        "max_new_tokens": max_new_tokens,
        "wall_s": wall,
        "problems_per_s": b.n_problems / wall,
        "gen_tokens_per_s": engine.tokens / engine.seconds,
        "gen_share": engine.seconds / wall,
        "mean_response_tokens": b.response_tokens_mean,
        "truncation_rate": b.truncation_rate,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument(
        "--servers",
        default="",
        help="also through an EnginePool over this many `megaopd serve` processes (e.g. 1,2), at each batch",
    )
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: on a shared 2-core machine more threads spin against other jobs)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"# torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for model in args.models.split(","):
            for batch in map(int, args.batches.split(",")):
                for servers in [0] + [int(x) for x in args.servers.split(",") if x]:
                    r = run(model, batch, args.problems, args.max_new_tokens, workdir, servers)
                    results.append(r)
                    print(json.dumps(r), flush=True)
    print(
        "\n| model | engine | generate batch | problems | new tokens | problems/s | gen tokens/s | generation "
        "share of time |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['model']} | {r['engine']} | {r['batch']} | {r['problems']} | {r['mean_response_tokens']:.0f} | "
            f"{r['problems_per_s']:.2f} | {r['gen_tokens_per_s']:.0f} | {100 * r['gen_share']:.0f}% |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
