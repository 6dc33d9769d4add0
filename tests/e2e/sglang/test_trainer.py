"""The trainer end to end against SGLang 0.5.23's own server (tests/e2e/sglang/conftest.py), on the tiny models:

- two Stable-OPD steps with `rollout.engine: remote` on SGLang: the actor's weights synced into the server
  every step (a weight-update session + the gloo group), the parity probe after every sync;
- two Stable-OPD steps with the teacher served by SGLang (`teacher.engine: remote`): its scores equal the
  in-job Megatron teacher's on the same rollouts within 1e-4;
- two plain OPD steps with a teacher of another tokenizer served by SGLang (teacher_xtok, `teacher.tokenizer:
  own`): the trainer re-tokenizes each response with the teacher's tokenizer, SGLang scores those ids, and the
  span log-probs spread back onto the student's tokens equal the in-job teacher's within 1e-4.

The runs are the golden runs' settings (tests/trainer/test_golden.py: student TP=2 on 2 gloo workers,
8 prompts x 2 samples of up to 48 tokens) cut to two steps.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from megaopd.parallel.launch import spawn
from megaopd.rollout.client import HttpEngine
from tests.e2e.sglang import _workers
from tests.e2e.sglang.conftest import ROOT, STUDENT, TEACHER, TEACHER_XTOK, gap, reference_logprobs
from tests.trainer import _workers as trainer_workers
from tests.trainer.test_golden import _step_metrics, golden_overrides

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

STEPS = 2
PRESET = os.path.join(ROOT, "examples", "tiny", "stable_opd.yaml")


def _config(run_dir, *extra):
    return load_config(MegaOPDConfig, PRESET, golden_overrides(str(run_dir)) + [f"trainer.max_steps={STEPS}", *extra])


PROBE = [1, 40, 75, 13, 200, 9, 31, 118, 2]


def checkpoint_logprobs() -> torch.Tensor:
    """transformers' log-probs of PROBE's tokens under the student checkpoint (what the server started with)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STUDENT, dtype=torch.float64, attn_implementation="eager").eval()
    return reference_logprobs(model, PROBE)[:-1].gather(-1, torch.tensor(PROBE[1:])[:, None])[:, 0]


def _requests(served, path: str) -> int:
    """How many times the server's access log shows POST `path` answered 200."""
    return sum(f'"POST {path} HTTP/1.1" 200' in line for line in served.log_tail(n_bytes=10**8).splitlines())


def _trained_steps(run_dir) -> dict[str, dict]:
    """The run's logged steps, asserted: steps 1..STEPS each once, a finite loss and a gradient at each, and the
    engine's own log-probs of its samples against the actor's recomputation (float32 both sides) within 1e-3."""
    steps = _step_metrics(str(run_dir))
    assert sorted(steps, key=int) == [str(s) for s in range(1, STEPS + 1)]
    for step, m in steps.items():
        assert math.isfinite(m["loss/total"]) and m["train/grad_norm"] > 0, (step, m)
        assert m["sync/logprob_gap_max"] < 1e-3, (step, m["sync/logprob_gap_max"])
    return steps


def test_stable_opd_with_rollouts_on_sglang(sglang_student, tmp_path):
    before = {
        p: _requests(sglang_student, p)
        for p in (
            "/begin_weight_update",
            "/end_weight_update",
            "/update_weights_from_distributed",
            "/init_weights_update_group",
        )
    }
    cfg = _config(
        tmp_path / "run", "rollout.engine=remote", f"rollout.urls=[{sglang_student.url}]", "rollout.parity_interval=1"
    )
    try:
        # check_parity runs after the start-up sync and after every step's: a gap out of bounds raises here.
        spawn(trainer_workers.run_presets, 2, args=([cfg],), timeout=1200)
        client = HttpEngine(sglang_student.url)
        version = client.weight_version()
        trained_gap = gap(client.prompt_logprobs(PROBE)[1:], checkpoint_logprobs())
    finally:
        sglang_student.restore_weights()
    assert gap(HttpEngine(sglang_student.url).prompt_logprobs(PROBE)[1:], checkpoint_logprobs()) < 1e-4
    after = {p: _requests(sglang_student, p) - n for p, n in before.items()}
    steps = _trained_steps(tmp_path / "run")
    print({s: (m["sync/logprob_gap_max"], m["loss/total"]) for s, m in steps.items()}, after)
    assert version == str(STEPS) and trained_gap > 1e-3  # the server holds the last step's weights, trained ones
    # One group for the run; a session around every sync (start-up, then each step), every update inside one.
    assert after["/init_weights_update_group"] == 1
    assert after["/begin_weight_update"] == after["/end_weight_update"] >= STEPS + 1
    assert after["/update_weights_from_distributed"] >= after["/begin_weight_update"]


def test_stable_opd_with_teacher_on_sglang(sglang_teacher, tmp_path):
    cfgs = [
        _config(tmp_path / "in_job"),
        _config(
            tmp_path / "served",
            "teacher.engine=remote",
            f"teacher.urls=[{sglang_teacher.url}]",
            f"teacher.path={TEACHER}",
        ),
    ]
    in_job, served = spawn(_workers.train_capturing_teacher, 2, args=(cfgs,), timeout=1500)[0]
    _assert_same_teacher_scores(in_job, served, "served - in-job teacher log q")
    # The rest of the step follows: the same losses to float32 rounding; no entropy from a server.
    a, b = in_job["metrics"], served["metrics"]
    assert "overlap/entropy_gap" in a and "overlap/entropy_gap" not in b
    for key in ("loss/total", "rollout/teacher_logprob_mean", "overlap/ratio", "train/grad_norm"):
        assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-5), (key, a[key], b[key])


def test_cross_tokenizer_opd_with_teacher_on_sglang(sglang_teacher_xtok, tmp_path):
    own = [f"trainer.max_steps={STEPS}", f"teacher.path={TEACHER_XTOK}", "teacher.tokenizer=own"]
    preset = os.path.join(ROOT, "examples", "tiny", "cross_tokenizer.yaml")
    cfgs = [
        # in the job a teacher of another tokenizer sits in the student's layout (TP=2)
        load_config(MegaOPDConfig, preset, golden_overrides(str(tmp_path / "in_job")) + own + ["teacher.tp=2"]),
        load_config(
            MegaOPDConfig,
            preset,
            golden_overrides(str(tmp_path / "served"))
            + own
            + ["teacher.engine=remote", f"teacher.urls=[{sglang_teacher_xtok.url}]"],
        ),
    ]
    in_job, served = spawn(_workers.train_capturing_teacher, 2, args=(cfgs,), timeout=1500)[0]
    _assert_same_teacher_scores(in_job, served, "SGLang - in-job span log q per student token")
    a, b = in_job["metrics"], served["metrics"]
    assert 0 <= a["opd/unaligned_frac"] < 0.5, a["opd/unaligned_frac"]  # <|im_end|> only: the text is aligned
    for key in ("loss/total", "rollout/teacher_logprob_mean", "opd/reverse_kl", "opd/unaligned_frac"):
        assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-5), (key, a[key], b[key])


def test_multi_turn_stable_opd_with_rollouts_on_sglang(sglang_student, tmp_path):
    """Two multi-turn Stable-OPD steps with SGLang generating every assistant turn: each turn's request
    continues from the trajectory's token ids (SGLang's input_ids), an environment answers every turn (the
    tiny student never calls a tool by itself), and the engine's log-probs of the student's tokens match
    the actor's recomputation over the whole trajectory."""
    from tests.envs import _workers as env_workers

    cfg = _config(
        tmp_path / "run",
        "rollout.engine=remote",
        f"rollout.urls=[{sglang_student.url}]",
        "env.name=calculator",
        "rollout.max_turns=2",
        "rollout.max_new_tokens=160",
        "rollout.max_trajectory_tokens=360",
        "trainer.prompts_per_step=4",
    )
    try:
        spawn(env_workers.run_presets_always_answering, 2, args=([cfg],), timeout=1200)
    finally:
        sglang_student.restore_weights()
    steps = _trained_steps(tmp_path / "run")
    for step, m in steps.items():
        assert m["traj/turns_mean"] > 1 and 0 < m["traj/env_token_share"] < 1, (step, m)
    print({s: (m["traj/turns_mean"], m["traj/env_token_share"], m["sync/logprob_gap_max"]) for s, m in steps.items()})


def _assert_same_teacher_scores(in_job, served, what: str) -> None:
    """Both runs sampled the same tokens at every step (embedded engine, same seed; step 2 after updates equal
    to float32 rounding), and the teacher's log-probs on their response tokens agree within 1e-4."""
    assert len(in_job["steps"]) == len(served["steps"]) == STEPS
    worst = 0.0
    for step, (a, b) in enumerate(zip(in_job["steps"], served["steps"]), start=1):
        assert torch.equal(a["tokens"], b["tokens"]), f"step {step}: the two runs sampled different tokens"
        m = a["mask"].bool()
        assert m.any() and torch.equal(m, b["mask"].bool())
        gap = float((a["teacher"][m] - b["teacher"][m]).abs().max())
        worst = max(worst, gap)
        print(f"step {step}: max |{what}| = {gap:.2e} over {int(m.sum())} tokens")
    assert worst < 1e-4


LORA = ["student.lora.enabled=true", "student.lora.rank=4", "student.lora.alpha=8", "optimizer.lr=1e-2"]


def test_lora_student_syncs_merged_weights_to_sglang(sglang_student, tmp_path):
    """A LoRA student with SGLang generating (issue 55): SGLang 0.5.23's LoRA routes need a GPU on this build
    (docs/engines.md), so rollout.lora_sync=auto sends the adapters merged into the base (float32 math, W +
    (alpha / r) B A) as full weights, and the parity probe after every sync holds: the engine's log-probs equal
    the actor's (base + adapters) within the parity bound. An explicit rollout.lora_sync=adapter is refused in one
    line naming the engine and the fix, before any weight is sent."""
    remote = ["rollout.engine=remote", f"rollout.urls=[{sglang_student.url}]", "rollout.parity_interval=1"]
    before = HttpEngine(sglang_student.url).weight_version()
    try:
        refused = _config(tmp_path / "adapter", *remote, *LORA, "rollout.lora_sync=adapter")
        with pytest.raises(Exception) as e:
            spawn(trainer_workers.run_presets, 2, args=([refused],), timeout=1200)
        assert "rollout.lora_sync=adapter" in str(e.value) and "rollout.lora_sync=merged" in str(e.value), e.value
        assert HttpEngine(sglang_student.url).weight_version() == before  # refused before the start-up sync
        cfg = _config(tmp_path / "run", *remote, *LORA)
        spawn(trainer_workers.run_presets, 2, args=([cfg],), timeout=1200)  # a parity gap out of bounds raises
        client = HttpEngine(sglang_student.url)
        version = client.weight_version()
        trained_gap = gap(client.prompt_logprobs(PROBE)[1:], checkpoint_logprobs())
    finally:
        sglang_student.restore_weights()
    steps = _trained_steps(tmp_path / "run")
    for step, m in steps.items():
        assert m["sync/adapter_bytes"] == 0 and m["sync/bytes"] > 0, (step, m)  # every sync merged, full weights
    print({s: (m["sync/logprob_gap_max"], m["sync/bytes"]) for s, m in steps.items()}, trained_gap)
    assert version == str(STEPS) and trained_gap > 1e-3  # the server holds the trained adapters, merged
