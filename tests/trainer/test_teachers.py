"""Teachers served by `megaopd serve` and several teachers per job, through the real trainer: a tiny
Stable-OPD step with the served teacher equals the in-job one's; with two teachers (one in the job, one
served, different weights) every sample's teacher log-probs are those of its routed teacher alone."""

import json
import math
import os

import pytest
import torch

from megaopd.config import load_config
from megaopd.config.schema import MegaOPDConfig
from megaopd.parallel.launch import spawn
from megaopd.rollout.embedded import EmbeddedEngine
from megaopd.serving.server import RolloutServer, ServeConfig
from tests.trainer import _workers
from tests.trainer.test_golden import _step_metrics, golden_overrides
from tests.trainer.tiny_models import ROOT

TINY = os.path.join(ROOT, "examples", "tiny")


def _serve(hf_dir):
    config = ServeConfig(hf_dir=hf_dir, port=0)
    return RolloutServer(config, engine=EmbeddedEngine(config.engine_config())).start()


@pytest.mark.slow
def test_served_teacher_step_matches_in_job_step(tmp_path):
    server = _serve(os.path.join(TINY, "models", "teacher"))
    try:
        base = golden_overrides("") + ["trainer.max_steps=1"]
        cfgs = [
            load_config(
                MegaOPDConfig, os.path.join(TINY, "stable_opd.yaml"), base + [f"run.dir={tmp_path / name}"] + extra
            )
            for name, extra in (("in_job", []), ("served", ["teacher.engine=remote", f"teacher.urls=[{server.url}]"]))
        ]
        spawn(_workers.run_presets, 2, args=(cfgs,), timeout=1200)
    finally:
        server.shutdown()
    in_job, served = (_step_metrics(str(tmp_path / n))["1"] for n in ("in_job", "served"))
    # Only the teacher's log-probs differ, by float32 rounding of two implementations (< 2e-5).
    # A served teacher gives no entropy: the overlap metrics leave out entropy_gap, nothing else.
    assert set(in_job) - set(served) == {"overlap/entropy_gap"} and set(served) <= set(in_job)
    # The step's FLOPs count the scoring passes run on the job's GPUs: an in-job teacher's, not a served one's.
    assert in_job["flops/model_step"] > served["flops/model_step"]
    assert in_job["flops/model_train"] == served["flops/model_train"]
    for key, value in served.items():
        if key.endswith("_step") and key.startswith("flops/"):
            continue
        value = in_job[key]
        assert math.isclose(served[key], value, rel_tol=1e-4, abs_tol=1e-5), (key, served[key], value)
    print({k: (in_job[k], served[k]) for k in ("loss/total", "rollout/teacher_logprob_mean", "overlap/ratio")})


@pytest.mark.slow
def test_two_teachers_each_sample_scored_by_its_teacher(tmp_path):
    """arith: the tiny teacher in the job (TP=1); algebra: the tiny STUDENT's weights behind `megaopd
    serve` (another model of the same vocabulary, so a mis-routed row shows)."""
    server = _serve(os.path.join(TINY, "models", "student"))
    try:
        cfg = load_config(
            MegaOPDConfig,
            os.path.join(TINY, "two_teachers.yaml"),
            golden_overrides(str(tmp_path))
            + [
                "teachers=[{name: arith, path: examples/tiny/models/teacher, tp: 1}, {name: algebra, engine: remote, "
                f"urls: ['{server.url}'], path: examples/tiny/models/student}}]",
                "trainer.max_steps=1",
            ],
        )
        out = spawn(_workers.two_teachers_rollout, 2, args=(cfg,), timeout=1200)[0]
    finally:
        server.shutdown()
    rows, mask = out["rows"], out["mask"].bool()
    assert rows["arith"] and rows["algebra"], out["sources"]  # both sources are in the batch
    for name, idx in rows.items():
        idx = torch.tensor(idx)
        got, alone, m = out["teacher"][idx], out["alone"][name][idx], mask[idx]
        # The routed pass packs its rows (trainer.pack_sequences), the lone pass pads them: float32 rounding only.
        assert (got[m] - alone[m]).abs().max() < 1e-4, name
        other = [n for n in rows if n != name][0]
        assert (got[m] - out["alone"][other][idx][m]).abs().max() > 1e-2  # the other teacher differs
    n = out["metrics"]
    assert {"rollout/teacher_logprob_mean/arith", "rollout/teacher_logprob_mean/algebra"} <= set(n)
    overall = n["rollout/teacher_logprob_mean"]
    a, b = (n[f"rollout/teacher_logprob_mean/{k}"] for k in ("arith", "algebra"))
    assert min(a, b) - 1e-9 <= overall <= max(a, b) + 1e-9


def _runs_by_parts(tmp_path, world: int, overrides: list[str], timeout: float) -> dict[int, dict[int, dict]]:
    """The tiny Stable-OPD preset for two steps at rollout.stream_parts 1 and 3 (with `overrides`): each run's
    logged metrics by step."""
    runs = {}
    for parts in (1, 3):
        run = str(tmp_path / f"parts_{parts}")
        cfg = load_config(
            MegaOPDConfig,
            os.path.join(TINY, "stable_opd.yaml"),
            golden_overrides(run)
            + [f"run.world_size={world}", "trainer.max_steps=2", f"rollout.stream_parts={parts}"]
            + overrides,
        )
        spawn(_workers.run_presets, world, args=([cfg],), timeout=timeout)
        with open(os.path.join(run, "metrics.jsonl")) as f:
            runs[parts] = {r["step"]: r for r in map(json.loads, f) if "event" not in r}
    return runs


def _assert_same_metrics(one: dict, streamed: dict, step: int) -> None:
    for key, value in one.items():
        # The engine's own log-probs of the same tokens round differently in another batch composition
        # (sync/logprob_gap_*, ~1e-6): the one thing the parts change besides timing.
        if isinstance(value, float) and not key.startswith(("time", "perf/", "sync/logprob_gap")):
            assert math.isclose(streamed[key], value, rel_tol=1e-5, abs_tol=1e-7), (step, key, streamed[key], value)


@pytest.mark.slow
def test_teacher_scores_streamed_while_generating_equal_scores_after(tmp_path, one_torch_thread):
    """rollout.stream_parts=3 against a served engine and a served teacher: each third of the batch goes to
    the teacher as it returns from the engine; the steps log what one request and scoring after it log."""
    engine, teacher = _serve(os.path.join(TINY, "models", "student")), _serve(os.path.join(TINY, "models", "teacher"))
    try:
        runs = _runs_by_parts(
            tmp_path,
            1,
            [
                "student.tp=1",
                "reference.tp=1",
                "teacher.tp=1",
                "rollout.engine=remote",
                f"rollout.urls=[{engine.url}]",
                "teacher.engine=remote",
                f"teacher.urls=[{teacher.url}]",
            ],
            timeout=600,
        )
    finally:
        engine.shutdown()
        teacher.shutdown()
    for step in (1, 2):
        one, streamed = runs[1][step], runs[3][step]
        assert streamed["pipeline/teacher_streamed_fraction"] == 1.0  # every row was scored while generating
        _assert_same_metrics(one, streamed, step)


@pytest.mark.slow
def test_in_job_passes_streamed_while_generating_equal_scores_after(tmp_path, one_torch_thread):
    """rollout.stream_parts=3 in sync mode at world 2 (actor DP=2, the in-job teacher at TP=2: another layout)
    against a served engine: the actor's and the teacher's passes score each third of the batch as it returns
    and route the scores to their owners once the batch is in; the steps log what scoring after logs."""
    engine = _serve(os.path.join(TINY, "models", "student"))
    try:
        runs = _runs_by_parts(
            tmp_path,
            2,
            ["student.tp=1", "reference.tp=1", "teacher.tp=2", "rollout.engine=remote", f"rollout.urls=[{engine.url}]"],
            timeout=900,
        )
    finally:
        engine.shutdown()
    for step in (1, 2):
        one, streamed = runs[1][step], runs[3][step]
        assert streamed["time/actor_logprobs"] < one["time/actor_logprobs"]  # the pass ran during the rollout
        _assert_same_metrics(one, streamed, step)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["in_job", "served"])
def test_a_teacher_with_a_context_of_its_own_scores_after_the_streamed_parts(tmp_path, one_torch_thread, where):
    """rollout.stream_parts=3 with a teacher shown the golden solution (teacher.context): the actor's pass still
    scores each part as it returns; the teacher, in the job or served, scores its views of the whole batch after
    it, and the steps log what one request and scoring after it log."""
    engine = _serve(os.path.join(TINY, "models", "student"))
    servers = [engine]
    overrides = [
        "student.tp=1",
        "reference.tp=1",
        "teacher.tp=1",
        "rollout.engine=remote",
        f"rollout.urls=[{engine.url}]",
        'teacher.context="{golden}\\n\\n{problem}\\n{instruction}"',
    ]
    if where == "served":
        servers.append(_serve(os.path.join(TINY, "models", "teacher")))
        overrides += ["teacher.engine=remote", f"teacher.urls=[{servers[-1].url}]"]
    try:
        runs = _runs_by_parts(tmp_path, 1, overrides, timeout=600)
    finally:
        for server in servers:
            server.shutdown()
    for step in (1, 2):
        one, streamed = runs[1][step], runs[3][step]
        assert streamed["pipeline/streamed_parts"] > 1  # the actor's pass ran on the parts
        _assert_same_metrics(one, streamed, step)
