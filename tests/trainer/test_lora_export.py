"""A LoRA run's outputs (issue 55): its final export holds the merged student (hf/) and the peft adapter folder beside
it (hf_adapter/, base_model_name_or_path = the student's HF base), and peft 0.21 loading the adapter onto the base
gives the merged export's log-probs; a LoRA checkpoint given as student.path is loaded with its adapters rebuilt
first, or refused in one line, never with its adapters dropped. TP=2 (2 gloo workers).

    pytest tests/trainer/test_lora_export.py
"""

import json
import os

import pytest
import torch

from megaopd.parallel.launch import spawn
from tests.trainer import _lora_workers
from tests.trainer.tiny_models import make_tiny_pair

PROMPT = [1, 5, 9, 14, 30, 41, 7, 7, 60, 2]


def _logprobs(model):
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])[:, 0]


@pytest.mark.slow
def test_final_export_holds_merged_and_adapter_and_checkpoint_keeps_adapters(tmp_path):
    peft = pytest.importorskip("peft")
    import transformers

    student, _ = make_tiny_pair(str(tmp_path / "models"))
    out = str(tmp_path / "run")
    res = spawn(_lora_workers.lora_checkpoint_and_export, 2, args=(student, out, 2), timeout=600)[0]
    assert res["same"] and res["base_model"] == student
    assert "is a LoRA checkpoint (rank 4" in res["refusal"] and "\n" not in res["refusal"]
    assert "--lora-export merged" in res["refusal"]
    with open(os.path.join(out, "hf_adapter", "adapter_config.json")) as f:
        config = json.load(f)
    assert config["base_model_name_or_path"] == os.path.abspath(student) and config["r"] == 4
    merged = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"), dtype=torch.float32).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(base, os.path.join(out, "hf_adapter")).eval()
    gap = (_logprobs(merged) - _logprobs(adapted)).abs().max().item()
    assert gap < 1e-4, gap
    assert (
        _logprobs(merged) - _logprobs(transformers.AutoModelForCausalLM.from_pretrained(student))
    ).abs().max() > 1e-3
