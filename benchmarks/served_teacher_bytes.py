"""Bytes a served teacher moves per step: a teacher of another tokenizer (teacher_xtok, teacher.tokenizer=own)
against a same-tokenizer one (the tiny teacher), both behind SGLang 0.5.23's own server on this CPU.

A step's teacher request is one /generate prefill (megaopd.rollout.schema.prefill_request, what
HttpEngine.score_prefill sends): every response after its prompt, scored from the first response token. The
same-tokenizer teacher gets the student's ids; teacher_xtok gets its own: the prompt rendered by its
tokenizer's chat template and the response text re-tokenized (megaopd.data.alignment.retokenize), as the
trainer sends them. Responses: the golden solutions of examples/tiny/data/opd.jsonl (`generations`), one
step of the tiny study's shape (32 prompts x 4 samples; the 4 samples of a prompt are its golden 4 times).
Bytes = the JSON request body and the raw answer body, as on the wire (no HTTP headers).

    PYTHONPATH=. python benchmarks/served_teacher_bytes.py     # starts both servers (1-3 minutes each here)
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megaopd.data.alignment import retokenize  # noqa: E402
from megaopd.models.hf_io import load_tokenizer  # noqa: E402
from megaopd.parallel.dist import find_free_port  # noqa: E402
from megaopd.rollout.schema import prefill_request  # noqa: E402
from megaopd.serving.sglang_launcher import ServerProcess, SGLangLaunchConfig, sglang_command, sglang_env  # noqa: E402

MODELS = os.path.join(ROOT, "examples", "tiny", "models")
STUBS = os.path.join(ROOT, "tests", "e2e", "sglang", "stubs")
PROMPTS, SAMPLES = 32, 4


def step_sequences(tok, own: bool) -> tuple[list[list[int]], list[int]]:
    """The step's sequences for a teacher with tokenizer `tok` (prompt + response ids) and each one's first
    response position."""
    student = load_tokenizer(os.path.join(MODELS, "student"))
    with open(os.path.join(ROOT, "examples", "tiny", "data", "opd.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()][:PROMPTS]
    seqs, firsts = [], []
    for r in rows:
        msgs = [{"role": "user", "content": r["problem"]}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        prompt = tok.encode(text, add_special_tokens=False)
        ids = student.encode(r["generations"][0], add_special_tokens=False)
        if own:  # the text the student wrote, in the teacher's tokens
            ids = retokenize(student.decode(ids), tok)[0]
        for _ in range(SAMPLES):
            seqs.append(list(prompt) + list(ids) + [2])  # <|im_end|>=2 ends both (the same special ids)
            firsts.append(len(prompt))
    return seqs, firsts


def measure(python: str, model: str, own: bool) -> dict:
    port = find_free_port()
    cfg = SGLangLaunchConfig(
        model_path=os.path.join(MODELS, model), port=port, device="cpu", python=python, max_total_tokens=16384
    )
    env = {**sglang_env(cfg), "PYTHONPATH": STUBS, "OMP_NUM_THREADS": "1"}
    proc = ServerProcess.start(
        sglang_command(cfg), url=cfg.url, startup_timeout_s=600, log_path=f"/tmp/bytes-{model}.log", env=env
    )
    try:
        seqs, firsts = step_sequences(load_tokenizer(os.path.join(MODELS, model)), own)
        body = json.dumps(prefill_request(seqs, firsts)).encode()
        req = urllib.request.Request(cfg.url + "/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            answer = resp.read()
    finally:
        proc.stop()
    scored = sum(len(s) - f for s, f in zip(seqs, firsts))
    return {"model": model, "scored": scored, "request": len(body), "answer": len(answer)}


def main() -> int:
    python = os.path.join(os.path.expanduser("~/.cache/megaopd/sglang-0.5.23-8b148e2bd213"), "bin", "python")
    same, cross = measure(python, "teacher", False), measure(python, "teacher_xtok", True)
    print("| teacher | tokens scored | request bytes | answer bytes | total | answer bytes / scored token |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in (same, cross):
        total = r["request"] + r["answer"]
        print(
            f"| {r['model']} | {r['scored']:,} | {r['request']:,} | {r['answer']:,} | {total:,} | "
            f"{r['answer'] / r['scored']:.1f} |"
        )
    ratio = lambda k: cross[k] / same[k]  # noqa: E731
    print(
        f"\nteacher_xtok / teacher: tokens {ratio('scored'):.2f}x, request {ratio('request'):.2f}x, "
        f"answer {ratio('answer'):.2f}x, total "
        f"{(cross['request'] + cross['answer']) / (same['request'] + same['answer']):.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
