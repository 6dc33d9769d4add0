"""A teacher of another vocabulary through the real trainer (teacher.tokenizer=own; the start-up check finds the
vocabularies differ): plain OPD on the tiny student, the teacher a random tiny model over
examples/tiny/tokenizer_xtok's 384 ids, in the job at the student's TP=2 and served by `megaopd serve`; both
train 2 steps with finite losses and span-summed advantages, and what cannot run cross-tokenizer is refused
at load in one line."""

import math
import os

import pytest

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from megaopd.parallel.launch import spawn
from megaopd.rollout.embedded import EmbeddedEngine
from megaopd.serving.server import RolloutServer, ServeConfig
from tests.scoring.test_cross_teacher_view import make_xtok_teacher
from tests.trainer import _workers
from tests.trainer.test_golden import _step_metrics, golden_overrides
from tests.trainer.tiny_models import ROOT

OPD = os.path.join(ROOT, "examples", "tiny", "opd.yaml")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return make_xtok_teacher(str(tmp_path_factory.mktemp("models") / "teacher_xtok"))


def test_what_cannot_run_cross_tokenizer_is_refused_at_load(teacher_dir):
    base = [f"teacher.path={teacher_dir}", "teacher.tokenizer=own", "teacher.tp=2"]
    cfg = load_config(MegaOPDConfig, OPD, base)
    cfg.validate()  # opd in the student's layout: fine
    with pytest.raises(ValueError, match=r"loss 'lsm' reads the teacher's .*top-K ids"):
        load_config(MegaOPDConfig, OPD, base + ["loss.name=lsm", "loss.config={}"]).validate()
    with pytest.raises(ValueError, match=r"cross-tokenizer mode\) and tp/pp/ep=\(1, 1, 1\).*set teacher.tp=2"):
        load_config(MegaOPDConfig, OPD, base + ["teacher.tp=1"]).validate()
    # Without tokenizer=own another vocabulary is the start-up check's error, which names the fix.
    from megaopd.models.hf_io import load_tokenizer
    from megaopd.trainer.roles import check_teacher_tokenizers

    plain = load_config(MegaOPDConfig, OPD, [f"teacher.path={teacher_dir}", "teacher.tp=2"])
    plain.validate()
    student = load_tokenizer(plain.student.path)
    with pytest.raises(ValueError, match=r"other ids.*set teacher.tokenizer=own"):
        check_teacher_tokenizers(student, plain.student.path, plain.teachers, [load_tokenizer(teacher_dir)], [2], print)
    said = []
    cross = set()
    check_teacher_tokenizers(
        student, cfg.student.path, cfg.teachers, [load_tokenizer(teacher_dir)], [2], said.append, cross
    )
    assert cross == {"teacher"} and "cross-tokenizer mode" in said[0]
    assert "the teacher has another tokenizer (256 student ids, 384 teacher ids" in said[1]  # alignment_report
    assert "spans" in said[2]


@pytest.mark.slow
def test_cross_tokenizer_teacher_trains_in_job_and_served(tmp_path, teacher_dir):
    config = ServeConfig(hf_dir=teacher_dir, port=0)
    server = RolloutServer(config, engine=EmbeddedEngine(config.engine_config())).start()
    own = [f"teacher.path={teacher_dir}", "teacher.tokenizer=own"]
    runs = {
        "in_job": own + ["teacher.tp=2", "trainer.pack_sequences=true", "trainer.max_tokens_per_micro_batch=512"],
        "served": own + ["teacher.engine=remote", f"teacher.urls=[{server.url}]"],
    }
    try:
        base = golden_overrides("") + ["trainer.max_steps=2", "student.tp=2", "reference.tp=2"]
        cfgs = [load_config(MegaOPDConfig, OPD, base + [f"run.dir={tmp_path / n}"] + x) for n, x in runs.items()]
        spawn(_workers.run_presets, 2, args=(cfgs,), timeout=1500)
    finally:
        server.shutdown()
    m = {n: _step_metrics(str(tmp_path / n)) for n in runs}
    for name, steps in m.items():
        assert set(steps) == {"1", "2"}, name
        for s in steps.values():
            assert math.isfinite(s["loss/total"]) and math.isfinite(s["rollout/advantage_mean"]), name
            # a random teacher over 384 ids: about log(384) = 5.95 nats a token below the student
            assert -12 < s["rollout/advantage_mean"] < -1, (name, s["rollout/advantage_mean"])
    # The same weights in the job and served, on the same responses of step 1: the same span log-probs.
    a, b = m["in_job"]["1"], m["served"]["1"]
    assert abs(a["rollout/teacher_logprob_mean"] - b["rollout/teacher_logprob_mean"]) < 1e-4
