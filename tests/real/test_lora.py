"""Two LoRA Stable-OPD steps of `megaopd train` on real models (issue 55): the pruned SmolLM2 (layers 16-19 removed)
as student with rank-16 adapters on every linear and its base frozen, the full SmolLM2-135M-Instruct as teacher,
the reference read from the student itself with its adapters off (no reference model loaded). The shipped LoRA
preset (examples/tiny/lora_opd.yaml: its loss, adapters and learning rate) with the models, data and budgets of
tests/real/test_train.py: world 1, 2 prompts x 2 samples, 40 new tokens.

Checked:
- the run trains: both steps log finite losses and a non-zero gradient norm, the engine (sent the adapters alone,
  rollout.lora_sync auto -> adapter) agrees with the actor, and the start-up log says no reference model was
  loaded, as `megaopd plan` counts it (no "reference weights" item; one with LoRA off);
- the final checkpoint's adapters moved from where the run started (A and B of every adapted linear) and its base
  is bit-equal to the HF student's (tests/real/_lora_worker.py);
- the final export holds hf/ (merged) and hf_adapter/ (peft); peft 0.21 loading hf_adapter/ onto the HF student in
  float64 gives the log-probs of the Megatron checkpoint with its adapters (float32) within the conversion bound
  (reference.LOGPROB_TOL, 1e-4: tests/real/test_conversion.py's), and so does the merged hf/;
- `megaopd plan`'s student weights, gradients and Adam state (plan.device=cpu) within 15% of the bytes measured on
  the model the run starts from, wrapped and stepped as the trainer does.
Measured (2026-11-29, 2-core CPU): docs/real_model.md, "LoRA on the real model".
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import yaml

from megaopd.parallel.launch import spawn
from tests.real import _lora_worker, reference
from tests.real.test_train import overrides, train_two_steps

pytestmark = [pytest.mark.slow, pytest.mark.real]

LORA_PRESET = os.path.join(reference.ROOT, "examples", "tiny", "lora_opd.yaml")
PLAN_TOL = 0.15
"""Issue 55: `megaopd plan` within 15% of measured."""
ANSWERS = [
    "7 times 8 is 56.",
    "Tom has 12 + 30 = 42 apples now.",
    "The sea is calm and blue under the morning sun.",
]
"""Assistant turns after reference.CHATS' user messages: real chat text to score."""


def conversations(tokenizer) -> list[list[int]]:
    rows = []
    for user, answer in zip(reference.CHATS, ANSWERS, strict=True):
        chat = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        rows.append(tokenizer(tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False).input_ids)
    return rows


def plan_items(args: list[str]) -> dict[str, float]:
    """`megaopd plan`'s items for the preset with args, on CPU: {name before its parenthesis: peak bytes}."""
    from megaopd.config import load_config
    from megaopd.config.plan import plan_for
    from megaopd.config.schema import MegaOPDConfig

    plan = plan_for(load_config(MegaOPDConfig, LORA_PRESET, [*args, "plan.device=cpu"]))
    return {i.name.split(" (")[0]: i.peak() for i in plan.items}


def hf_logprobs(model, rows: list[list[int]]) -> list[torch.Tensor]:
    return [reference.token_logprobs(model, r) for r in rows]


def gap(a: list, b: list) -> float:
    return max(float((torch.as_tensor(x, dtype=torch.float64) - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_two_lora_stable_opd_steps(smollm2, smollm2_student, tokenizer, tmp_path):
    peft = pytest.importorskip("peft")
    run = tmp_path / "run"
    args = overrides(smollm2_student, smollm2, str(run))
    log, steps = train_two_steps(args, run, timeout=1200, preset=LORA_PRESET)

    # No reference model: the log says so, and the plan counts none (one when LoRA is off).
    assert "[models] reference: the student's base with its LoRA adapters off" in log, log[-4000:]
    planned = plan_items(args)
    assert "reference weights" not in planned and "reference weights" in plan_items(
        [*args, "student.lora.enabled=false"]
    )
    # B starts at zero: at step 1 the student is its base bit for bit (KL exactly 0); at step 2 it is not.
    assert steps[1]["loss/ref_kl"] == 0.0 and steps[2]["loss/ref_kl"] > 0, [m["loss/ref_kl"] for m in steps.values()]
    for m in steps.values():
        assert math.isfinite(m["rollout/teacher_logprob_mean"]) and m["sync/logprob_gap_max"] < 1e-3, m

    # The final export: the merged student and the peft adapter folder for the HF student.
    for folder, name in (("hf", "model.safetensors"), ("hf_adapter", "adapter_model.safetensors")):
        assert (run / folder / name).is_file(), sorted(os.listdir(run))
    adapter_config = json.loads((run / "hf_adapter" / "adapter_config.json").read_text())
    config = yaml.safe_load((run / "config.yaml").read_text())
    lora = config["student"]["lora"]
    assert adapter_config["base_model_name_or_path"] == os.path.abspath(smollm2_student)
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (lora["rank"], lora["alpha"])

    # The Megatron checkpoint with its adapters; its base against the HF student; the bytes the plan counts.
    rows = conversations(tokenizer)
    ckpt = str(run / "checkpoints" / "step_000002")
    out = spawn(
        _lora_worker.lora_run_outcome,
        1,
        args=(ckpt, smollm2_student, lora, rows, config["trainer"]["seed"]),
        timeout=900,
        env={"OMP_NUM_THREADS": "1"},
    )[0]
    assert out["base_params"] > 0 and out["base_changed"] == [], out["base_changed"][:4]
    assert out["adapters"] == 4 * 26 and out["moved"] == {"lora_A": 104, "lora_B": 104}, out["moved"]

    # peft onto the HF base (float64) and the merged export against the Megatron model with adapters (float32).
    base = reference.load_hf(smollm2_student)
    base_lps = hf_logprobs(base, rows)
    adapted = peft.PeftModel.from_pretrained(base, str(run / "hf_adapter")).double().eval()
    peft_lps = hf_logprobs(adapted, rows)
    with adapted.disable_adapter():
        assert gap(hf_logprobs(adapted, rows), base_lps) == 0.0
    del adapted, base
    merged_lps = hf_logprobs(reference.load_hf(str(run / "hf")), rows)
    peft_gap, merged_gap = gap(out["logprobs"], peft_lps), gap(out["logprobs"], merged_lps)
    moved_by = gap(out["logprobs"], base_lps)
    assert peft_gap < reference.LOGPROB_TOL and merged_gap < reference.LOGPROB_TOL, (peft_gap, merged_gap)
    assert moved_by > 10 * reference.LOGPROB_TOL, moved_by  # the adapters matter: the comparison is not vacuous

    # megaopd plan against the measured bytes (float32: Adam's m and v, no master copy).
    measured = out["measured"]
    pairs = {
        "student weights": measured["weights"],
        "student gradients": measured["gradients"],
        "Adam states": measured["adam"],
    }
    ratios = {name: planned[name] / got for name, got in pairs.items()}
    optimizer_on_disk = sum(f.stat().st_size for f in (run / "checkpoints" / "step_000002" / "optimizer").rglob("*"))
    print(
        f"lora_opd on SmolLM2: {measured['adapter_params']} adapter params; "
        + "; ".join(
            f"step {s}: loss {m['loss/total']:.4f}, ref_kl {m['loss/ref_kl']:.2e}, response "
            f"{m['rollout/response_length_mean']:.1f} tokens, {m['time/step']:.1f} s (sync {m['time/sync']:.2f} s)"
            for s, m in sorted(steps.items())
        )
        + f"; max |log-prob| gaps to the Megatron checkpoint: peft {peft_gap:.2e}, merged {merged_gap:.2e}, "
        f"base {moved_by:.2e}; plan / measured bytes: "
        + ", ".join(f"{n} {planned[n]:.4g} / {pairs[n]:.4g} = {ratios[n]:.3f}" for n in pairs)
        + f"; optimizer/ on disk {optimizer_on_disk} bytes"
    )
    for name, ratio in ratios.items():
        assert abs(ratio - 1) <= PLAN_TOL, (name, planned[name], pairs[name])
    # the run's own Adam state as its checkpoint stores it (torch_dist files: the tensors and their metadata)
    assert abs(planned["Adam states"] / optimizer_on_disk - 1) <= PLAN_TOL, (planned["Adam states"], optimizer_on_disk)
