"""One extraction setting, honoured everywhere: the trainer's rollout rewards (texts_and_rewards) and its
validation (val/accuracy, val/answers_found and the few_answers warning) read metrics.reward.extract, as
`megaopd eval` reads --extract (tests/eval/test_evaluate.py). Real tokenizer, one gloo rank, scripted texts."""

import json
import os
from types import SimpleNamespace

import pytest

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from megaopd.metrics import RewardConfig
from megaopd.models.hf_io import load_tokenizer
from megaopd.rollout.protocol import Sample
from megaopd.trainer.run_log import RunLog
from megaopd.trainer.trainer import texts_and_rewards
from megaopd.trainer.validation import validate
from tests.eval.scripted_engine import ScriptedEngine
from tests.trainer.tiny_models import ROOT

TEXTS = ["3 + 4 = 7.", "The answer is 42.", "The answer is 5.", "no idea"]
GOLDS = ["7", "42", "6", "1"]


pytestmark = pytest.mark.usefixtures("one_gloo_rank")  # the code under test calls torch.distributed


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(os.path.join(ROOT, "examples", "tiny", "models", "student"))


def _config(tmp_path, extract: str | None) -> MegaOPDConfig:
    val = tmp_path / "val.jsonl"
    val.write_text(
        "".join(json.dumps({"id": str(i), "problem": f"problem {i}", "answer": g}) + "\n" for i, g in enumerate(GOLDS))
    )
    overrides = [
        f"run.dir={tmp_path / 'run'}",
        f"validation.path={val}",
        "validation.max_problems=0",
        "validation.max_new_tokens=16",
        "run.world_size=1",
        "student.tp=1",
        "reference.tp=1",
    ]
    if extract:
        overrides.append(f"metrics.reward.extract={extract}")
    return load_config(MegaOPDConfig, os.path.join(ROOT, "examples", "tiny", "stable_opd.yaml"), overrides)


def test_rollout_rewards_follow_the_setting(tok):
    samples = [Sample([1, 2], tok(t, add_special_tokens=False)["input_ids"], [], "stop") for t in TEXTS]
    examples = [SimpleNamespace(answer=g) for g in GOLDS]
    texts, boxed = texts_and_rewards(tok, samples, examples, 1, None)
    assert texts == TEXTS and boxed == [0.0, 0.0, 0.0, 0.0]
    _, number = texts_and_rewards(tok, samples, examples, 1, None, RewardConfig(extract="number"))
    assert number == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("extract, accuracy, found", [(None, 0.0, 0), ("number", 0.5, 3), ("answer_is", 0.25, 2)])
def test_validation_follows_the_setting_and_counts_answers(tok, tmp_path, extract, accuracy, found):
    cfg = _config(tmp_path, extract)
    log = RunLog(cfg.run.dir, max_steps=5, tensorboard=False, progress_bar="off")
    try:
        m = validate(ScriptedEngine(tok, TEXTS), tok, cfg, 3, [], log)
    finally:
        log.close()
    assert m["val/accuracy"] == accuracy
    assert (m["val/answers_found"], m["val/answers_found_count"]) == (found / 4, found)
    events = [json.loads(row) for row in open(os.path.join(cfg.run.dir, "metrics.jsonl"))]
    warned = [e for e in events if e.get("event") == "few_answers"]
    if found:
        assert not warned
    else:  # boxed, the default: one line saying so and how to switch
        (w,) = warned
        assert w["step"] == 3 and (w["answers_found"], w["responses"]) == (0, 4)
        assert w["message"].startswith("0 of 4 responses had a \\boxed{} answer (extract=boxed)")
        assert "metrics.reward.extract=number" in w["message"]
