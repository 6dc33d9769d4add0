"""tools/convert_hf_to_megatron.py on SmolLM2-135M-Instruct, then `megaopd logprobs` of the checkpoint at two
layouts, against transformers' float64 forward.

Written at TP=3 (9 query heads / 3 KV heads split three ways; the 49,152-token vocabulary in three shards) and
scored at TP=3 and at TP=1 x PP=2 (read back across layouts, the 30 layers split in two stages, the tied
embedding copied to the last stage), on real chat text: each prompt with transformers' greedy answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.real import reference

pytestmark = [pytest.mark.slow, pytest.mark.real]

LAYOUTS = {"tp3": ["--tp", "3", "--pp", "1"], "tp1_pp2": ["--tp", "1", "--pp", "2"]}


def _run(cmd: list[str], timeout: int = 900) -> None:
    env = {**os.environ, "PYTHONPATH": reference.ROOT, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=reference.ROOT, check=False)
    assert p.returncode == 0, f"{cmd}\nstdout:\n{p.stdout[-2000:]}\nstderr:\n{p.stderr[-4000:]}"


@pytest.fixture(scope="module")
def checkpoint(smollm2, tmp_path_factory) -> str:
    ckpt = str(tmp_path_factory.mktemp("smollm2_megatron") / "tp3")
    _run(
        [
            sys.executable,
            os.path.join(reference.ROOT, "tools", "convert_hf_to_megatron.py"),
            "--hf-dir",
            smollm2,
            "--out",
            ckpt,
            "--tp",
            "3",
        ]
    )
    with open(os.path.join(ckpt, "megaopd_checkpoint.json")) as f:
        meta = json.load(f)
    assert (meta["tp"], meta["pp"], meta["dtype"]) == (3, 1, "float32")
    return ckpt


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logprobs_equal_transformers_float64(checkpoint, layout, chat_prompts, hf_greedy, hf64, tmp_path):
    rows = [p + g.tokens for p, g in zip(chat_prompts, hf_greedy)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    _run(
        [
            sys.executable,
            "-m",
            "megaopd.cli",
            "logprobs",
            "--ckpt",
            checkpoint,
            *LAYOUTS[layout],
            "--input",
            str(inp),
            "--output",
            str(out),
        ]
    )
    got = [json.loads(line)["logprobs"] for line in out.read_text().splitlines()]
    worst = 0.0
    for row, lps in zip(rows, got, strict=True):
        expected = reference.token_logprobs(hf64, row)
        assert len(lps) == len(expected)
        worst = max(worst, float((torch.tensor(lps, dtype=torch.float64) - expected).abs().max()))
    print(f"{layout}: {sum(map(len, got))} log-probs, max |megatron - transformers float64| {worst:.2e}")
    assert worst < reference.LOGPROB_TOL
