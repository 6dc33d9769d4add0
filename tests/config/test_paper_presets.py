"""examples/paper presets resolve to the paper's settings (read from `megaopd config` output), and the
context extension writes the same RoPE change into every folder of a model (tools/extend_context.py)."""

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tests._cluster_inputs import cluster_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
DIRS = {
    "Qwen2.5-Math-7B": "qwen2.5-math-7b",
    "Qwen2.5-Math-1.5B": "qwen2.5-math-1.5b",
    "OpenThinker3-7B": "openthinker3-7b",
    "DeepSeek-R1-Distill-Qwen-7B": "r1-distill-qwen-7b",
}


def _run(*args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": ROOT, **(env_extra or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


@pytest.fixture
def cluster_env(tmp_path):
    return cluster_inputs(tmp_path, DIRS, extend_qwen=False)  # Qwen2.5-Math as published (4096 positions)


@pytest.mark.parametrize(
    "preset,student,teacher,tp",
    [
        ("stable_opd_7b", "Qwen2.5-Math-7B", "OpenThinker3-7B", 2),
        ("stable_opd_1p5b", "Qwen2.5-Math-1.5B", "DeepSeek-R1-Distill-Qwen-7B", 1),
    ],
)
def test_paper_presets_resolve_to_the_papers_settings(cluster_env, preset, student, teacher, tp):
    path = f"examples/paper/{preset}.yaml"
    # Unextended Qwen2.5-Math (4096 positions): refused with the fix, never silently edited.
    r = _run("-m", "megaopd.cli", "config", path, env_extra=cluster_env)
    assert r.returncode == 2 and "max_position_embeddings=4096" in r.stderr and "extend_context.py" in r.stderr
    r = _run("tools/extend_context.py", "--recipe", "luffy", os.path.join(cluster_env["MODELS_DIR"], student))
    assert r.returncode == 0, r.stderr
    r = _run("-m", "megaopd.cli", "config", path, env_extra=cluster_env)
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["trainer"]["prompts_per_step"] == 64 and cfg["trainer"]["samples_per_prompt"] == 4
    assert cfg["rollout"]["temperature"] == 1.0 and cfg["rollout"]["max_new_tokens"] == 8192
    assert cfg["optimizer"]["lr"] == 1e-6 and cfg["optimizer"]["use_distributed_optimizer"] is True
    assert cfg["data"]["max_golden_len"] == 8192 and cfg["data"]["max_prompt_len"] == 1024
    assert cfg["metrics"]["repetition"]["window_chars"] == 10000
    assert cfg["metrics"]["repetition"]["ratio_threshold"] == 10.0
    assert cfg["validation"]["path"].endswith("/math500.jsonl") and cfg["validation"]["max_problems"] == 0
    assert cfg["validation"]["temperature"] == 0.6
    assert cfg["loss"]["name"] == "stable_opd"
    # `megaopd config` shows every key of the loss's config, its defaults included.
    assert cfg["loss"]["config"]["sft_weight"] == 0.1 and cfg["loss"]["config"]["ref_kl_weight"] == 0.01
    assert cfg["loss"]["config"]["opd"]["eps_high"] == 0.2 and "teacher" not in cfg
    assert cfg["student"]["path"] == os.path.join(cluster_env["MODELS_DIR"], student)
    # The preset's `teacher:` is resolved into the one teacher list, named "teacher".
    assert [(t["name"], t["path"]) for t in cfg["teachers"]] == [
        ("teacher", os.path.join(cluster_env["MODELS_DIR"], teacher))
    ]
    assert cfg["student"]["tp"] == cfg["reference"]["tp"] == tp and cfg["student"]["dtype"] == "bfloat16"
    assert cfg["reference"]["offload_between_uses"] and cfg["teachers"][0]["offload_between_uses"]
    # The layout the comments were sized with fits the H200.
    r = _run("-m", "megaopd.cli", "plan", path, env_extra=cluster_env)
    assert r.returncode == 0, r.stdout + r.stderr


def test_extend_context_on_a_tiny_hf_dir_and_a_checkpoint(tmp_path):
    from transformers import AutoConfig

    from megaopd.models.hf_config import read_hf_config

    hf = tmp_path / "hf"
    shutil.copytree(os.path.join(ROOT, "examples", "tiny", "models", "student"), hf)
    ckpt = tmp_path / "ckpt"
    (ckpt / "hf").mkdir(parents=True)
    shutil.copy(hf / "config.json", ckpt / "hf" / "config.json")  # a megaopd checkpoint keeps it at hf/
    original = (hf / "config.json").read_text()
    r = _run("tools/extend_context.py", "--recipe", "open-r1", str(hf), str(ckpt))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("-> 300000") == 2 and "max_position_embeddings 512 -> 32768" in r.stdout
    for cfg_dir in (hf, ckpt / "hf"):
        ours = read_hf_config(str(cfg_dir))
        assert (ours.rope_theta, ours.max_position_embeddings) == (300000.0, 32768)
        theirs = AutoConfig.from_pretrained(str(cfg_dir))  # what an engine built with transformers reads
        assert theirs.rope_parameters["rope_theta"] == 300000.0 and theirs.max_position_embeddings == 32768
    assert (hf / "config.json.orig").read_text() == original
    again = _run("tools/extend_context.py", "--recipe", "open-r1", str(hf))
    assert again.returncode == 0 and "already" in again.stdout
    bad = _run("tools/extend_context.py", "--recipe", "luffy", str(tmp_path / "nothing"))
    assert bad.returncode == 1 and "no config.json" in bad.stderr
