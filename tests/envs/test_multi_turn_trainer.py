"""A multi-turn step through the real trainer (2 ranks, student TP=2, in-job teacher): the actor's and the
teacher's log-probs of every position of every trajectory (the student's and the environment's tokens,
scored in one pass) equal a float64 HF forward of the trajectory; the engine's log-probs match at the
student's tokens; the step trains on the student's tokens only."""

import os

import pytest
import torch

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from megaopd.parallel.launch import spawn
from tests.envs import _workers
from tests.trainer.test_golden import golden_overrides
from tests.trainer.tiny_models import ROOT

TINY = os.path.join(ROOT, "examples", "tiny")


def _hf_logprobs(path, tokens_S):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=tokens_S[None]).logits[0], -1)
    return lp[:-1].gather(-1, tokens_S[1:, None])[:, 0]


@pytest.mark.slow
def test_multi_turn_scores_equal_float64_hf_and_train_on_student_tokens(tmp_path):
    cfg = load_config(
        MegaOPDConfig,
        os.path.join(TINY, "stable_opd.yaml"),
        golden_overrides(str(tmp_path))
        + [
            "env.name=calculator",
            "rollout.max_turns=2",
            "rollout.max_trajectory_tokens=360",
            "rollout.max_new_tokens=160",
            "trainer.prompts_per_step=2",
            "trainer.samples_per_prompt=2",
            "trainer.micro_batch_size=2",
            "trainer.max_steps=1",
        ],
    )
    out = spawn(_workers.multi_turn_rollout, 2, args=(cfg,), timeout=1200)[0]
    assert max(out["turns"]) == 2, out["turns"]
    for b in range(out["tokens"].shape[0]):
        n = int(out["prompt_lens"][b] + out["response_lens"][b])
        tokens = out["tokens"][b, :n]
        P = int(out["prompt_lens"][b])
        for role, path in (("actor", "student"), ("teacher", "teacher")):
            want = _hf_logprobs(os.path.join(TINY, "models", path), tokens)[P - 1 :]
            got = out[role][b, P - 1 : n - 1].double()
            assert (got - want).abs().max() < 2e-4, (role, b, (got - want).abs().max())
        on = out["mask"][b, : n - 1].bool()
        eng = out["engine"][b, : n - 1].double()
        assert (eng[on] - out["actor"][b, : n - 1][on]).abs().max() < 2e-4
    m = out["metrics"]
    assert m["traj/turns_mean"] > 1 and 0 < m["traj/env_token_share"] < 1
    assert m["traj/truncated_turns_rate"] + m["traj/truncated_tokens_rate"] == 1.0  # the env never ends them
    assert m["rollout/response_length_mean"] == pytest.approx(float(out["mask"].sum()) / out["mask"].shape[0])
    assert torch.isfinite(torch.tensor(m["loss/total"]))
