"""A LoRA student trained against a real `megaopd serve` process (issue 55): the trainer's weight sync sends the
base once (the start-up sync, over the weight-update group) and then the adapters alone through POST
/load_lora_adapter (megaopd.sync.http_lora, rollout.lora_sync auto -> adapter), the engine generates with base plus
adapter, and the parity probe after every sync holds (float32, rollout.parity_tolerance 1e-3) as do the sampled
tokens' engine/actor gaps (sync/logprob_gap_max); resumed against the same server, the run sends the base again.

    pytest -m slow tests/trainer/test_lora_served.py
"""

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from megaopd.parallel.dist import find_free_port
from tests.trainer.tiny_models import ROOT

TINY = os.path.join(ROOT, "examples", "tiny")


def serve(hf_dir: str, log_path: str) -> tuple[subprocess.Popen, str]:
    """`megaopd serve` of hf_dir in its own process, healthy; (process, url)."""
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "megaopd.cli", "serve", "--hf-dir", hf_dir, "--port", str(port), "--num-threads", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, open(log_path).read()
        assert time.monotonic() < deadline, "megaopd serve did not become healthy"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)


def lora_overrides(run_dir: str) -> list[str]:
    """The LoRA preset shrunk to a few seconds a step, one process."""
    return [
        f"run.dir={run_dir}",
        "run.world_size=1",
        "student.tp=1",
        "reference.tp=1",
        "teacher.tp=1",
        "trainer.prompts_per_step=4",
        "trainer.samples_per_prompt=2",
        "trainer.micro_batch_size=4",
        "trainer.eval_interval=0",
        "rollout.max_new_tokens=16",
        "validation.path=''",
        "logging.tensorboard=false",
        "logging.progress_bar=off",
    ]


@pytest.mark.slow
def test_lora_student_syncs_adapters_alone_to_megaopd_serve(tmp_path):
    proc, url = serve(os.path.join(TINY, "models", "student"), str(tmp_path / "serve.log"))
    run = str(tmp_path / "run")

    def train(steps):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "megaopd.cli",
                "train",
                os.path.join(TINY, "lora_opd.yaml"),
                *lora_overrides(run),
                f"trainer.max_steps={steps}",
                "trainer.save_interval=100",
                "rollout.engine=remote",
                f"rollout.urls=[{url}]",
                "rollout.parity_interval=1",
            ],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        with urllib.request.urlopen(url + "/get_model_info", timeout=10) as r:
            assert json.load(r)["weight_version"] == str(steps)  # the adapter's name, the trainer's step
        return out

    try:
        out = train(3)
        # Resumed against the same server, which holds the base with step 3's adapter merged in: the new run's
        # first sync sends the base again (the engine merges into the base it keeps: it must be the actor's).
        resumed = train(4)
    finally:
        proc.kill()
        proc.wait()
    with open(os.path.join(run, "metrics.jsonl")) as f:
        steps = {r["step"]: r for r in map(json.loads, f) if "event" not in r}
    assert sorted(steps) == [1, 2, 3, 4]
    adapter = steps[2]["sync/adapter_bytes"]
    # Step 1 logs the start-up sync (the base, then the adapter) and its own (the adapter alone).
    base = steps[1]["sync/bytes"] - 2 * adapter
    assert steps[1]["sync/adapter_bytes"] == 2 * adapter and base > 0
    for s in (2, 3):
        assert steps[s]["sync/bytes"] == steps[s]["sync/adapter_bytes"] == adapter > 0
        assert steps[s]["sync/logprob_gap_max"] < 1e-3, steps[s]
    print(f"bytes per sync, adapter alone vs the base: {adapter:,.0f} vs {base:,.0f} ({adapter / base:.1%})")
    assert adapter < base / 2  # rank 16 on every linear of a hidden-96 student: about a third
    parity = re.findall(r"weight-sync parity at step (\d+): .* max ([0-9.e+-]+);", out.stdout)
    assert [int(s) for s, _ in parity] == [0, 1, 2, 3], out.stdout[-3000:]
    assert max(float(m) for _, m in parity) < 1e-3
    assert "resumed from" in resumed.stdout
    assert steps[4]["sync/bytes"] == base + 2 * adapter and steps[4]["sync/adapter_bytes"] == 2 * adapter
    parity = re.findall(r"weight-sync parity at step (\d+): .* max ([0-9.e+-]+);", resumed.stdout)
    assert [int(s) for s, _ in parity] == [3, 4] and max(float(m) for _, m in parity) < 1e-3, resumed.stdout[-3000:]
