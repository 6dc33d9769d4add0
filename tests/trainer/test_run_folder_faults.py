"""Faults in a run folder and in checkpoints handed in, end to end on a real tiny run (world 1, 3 steps):
a lost `latest`, flipped and truncated shards, and pickle payloads in a checkpoint's metadata (torch DCP's
`model/.metadata`, megatron's `common.pt`) read by the converter, a model path and a resume. Each checks a
harm that is easy to cause and hard to see (a payload that runs; a run that restarts at step 0 and prunes its
new step; a flipped byte unnoticed; a truncated shard as a bare EOFError). docs/run_folder.md says what a run
folder promises."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megaopd.models import manifest as mf
from tests.trainer._procs import copy_run, one_line_refusal, one_rank_run, start_python, step_rows, train, train_args
from tests.trainer.tiny_models import ROOT, make_tiny_pair

CONVERTER = os.path.join(ROOT, "tools", "convert_megatron_to_hf.py")


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _convert(ckpt, out, env=None):
    return subprocess.run(
        [sys.executable, CONVERTER, "--ckpt", ckpt, "--out", out],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(models, run folder after 3 steps: step_000002 and step_000003 kept, latest -> step_000003)."""
    base = tmp_path_factory.mktemp("faults")
    models = make_tiny_pair(str(base / "models"))
    run = str(base / "run")
    r = train(one_rank_run(base, models, run, 3))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["latest", "step_000002", "step_000003"]
    return models, run


def _step_rows(run):
    return [r["step"] for r in step_rows(run)]


def _one_layer_less_in_config(folder):
    """Makes the folder's config.json name one layer fewer than its weights hold; returns how many they hold."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    layers = config["num_hidden_layers"]
    config["num_hidden_layers"] = layers - 1
    with open(path, "w") as f:
        json.dump(config, f)
    return layers


def _with_payload(step_dir, rel, marker, torch_save=False):
    """An attacker's copy: `rel` replaced by a payload and the manifest made again to match it."""
    path = os.path.join(step_dir, rel)
    if torch_save:
        import torch

        torch.save({"optimizer": Payload(marker)}, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(Payload(marker), f)
    mf.write_manifest(step_dir, mf.hash_files(step_dir, mf.list_files(step_dir)), mf.read_manifest(step_dir).step)
    return step_dir


@pytest.mark.slow
def test_lost_latest_resumes_from_newest_complete_step_keeps_checkpoints_and_logs_each_step_once(trained, tmp_path):
    run = copy_run(trained[1], tmp_path)
    os.remove(os.path.join(run, "checkpoints", "latest"))
    r = train(one_rank_run(tmp_path, trained[0], run, 4))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "latest is missing: resuming from the newest complete step" in out and "at step 3" in out, out[-3000:]
    checkpoints = os.path.join(run, "checkpoints")
    assert sorted(d for d in os.listdir(checkpoints) if d.startswith("step_")) == ["step_000003", "step_000004"]
    assert open(os.path.join(checkpoints, "latest")).read() == "step_000004"
    for name in ("step_000003", "step_000004"):
        assert mf.verify(os.path.join(checkpoints, name)) is None
    steps = _step_rows(run)
    assert sorted(steps) == [1, 2, 3, 4], steps  # each step once, none trained over from 0


@pytest.mark.slow
def test_truncated_shard_names_the_file_and_the_previous_complete_step(trained, tmp_path):
    run = copy_run(trained[1], tmp_path)
    shard = os.path.join(run, "checkpoints", "step_000003", "model", "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    r = train(one_rank_run(tmp_path, trained[0], run, 4))
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert f"{shard} is {os.path.getsize(shard)} bytes" in out, out[-3000:]
    assert "newest step that verifies is" in out and "step_000002 (step 2)" in out, out[-3000:]
    assert "EOFError" not in out
    assert len(_step_rows(run)) == 3  # nothing logged, nothing saved
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["latest", "step_000002", "step_000003"]


@pytest.mark.slow
def test_flipped_bytes_in_a_shard_are_named_by_the_converter(trained, tmp_path):
    step = str(tmp_path / "step")
    shutil.copytree(os.path.join(trained[1], "checkpoints", "step_000003"), step)
    shard = os.path.join(step, "model", "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[4096:4104] = bytes(b ^ 0xFF for b in data[4096:4104])  # 8 bytes inside a tensor: torch reads them fine
    open(shard, "wb").write(bytes(data))
    r = _convert(step, str(tmp_path / "hf"))
    assert f"{shard} differs from its manifest.json" in one_line_refusal(r, 2)
    assert not os.path.exists(tmp_path / "hf" / "model.safetensors")


@pytest.mark.slow
def test_payload_in_checkpoint_pickles_is_not_run_by_the_converter(trained, tmp_path):
    for rel, torch_save in (("model/.metadata", False), ("model/common.pt", True)):
        marker = str(tmp_path / f"pwned_{rel.replace('/', '_')}")
        step = str(tmp_path / f"step_{torch_save}")
        shutil.copytree(os.path.join(trained[1], "checkpoints", "step_000003"), step)
        _with_payload(step, rel, marker, torch_save)
        # TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 made megatron's torch.load(common.pt) a plain unpickle before.
        r = _convert(step, str(tmp_path / f"hf_{torch_save}"), env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
        assert not os.path.exists(marker), rel
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert f"{os.path.join(step, rel)} pickles posix.system" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_payload_in_metadata_is_not_run_by_a_model_path_or_a_resume(trained, tmp_path):
    marker = str(tmp_path / "pwned")
    step = _with_payload(
        shutil.copytree(os.path.join(trained[1], "checkpoints", "step_000003"), str(tmp_path / "handed_in")),
        "model/.metadata",
        marker,
    )
    r = train(one_rank_run(tmp_path, trained[0], str(tmp_path / "fresh"), 1) + [f"student.path={step}"])
    assert not os.path.exists(marker)
    assert r.returncode != 0 and "model/.metadata pickles posix.system" in r.stdout + r.stderr, r.stderr[-3000:]

    run = copy_run(trained[1], tmp_path)
    _with_payload(os.path.join(run, "checkpoints", "step_000003"), "model/.metadata", marker)
    r = train(one_rank_run(tmp_path, trained[0], run, 4))
    assert not os.path.exists(marker)
    assert r.returncode != 0 and "model/.metadata pickles posix.system" in r.stdout + r.stderr, r.stderr[-3000:]


@pytest.mark.slow
def test_an_hf_folder_with_more_layers_than_its_config_names_is_refused_in_one_line(trained, tmp_path):
    """Issue 53: num_hidden_layers: N-1 over N layers trained an (N-1)-layer model and exited 0."""
    student = str(tmp_path / "student")
    shutil.copytree(trained[0][0], student)
    layers = _one_layer_less_in_config(student)
    run = str(tmp_path / "run")
    overrides = [o for o in one_rank_run(tmp_path, trained[0], run, 1) if not o.startswith("student.path")]
    r = train([*overrides, f"student.path={student}"])
    err = one_line_refusal(r, 1)
    assert f"{student}: " in err and f"num_hidden_layers: {layers - 1} but the weights hold {layers} layers" in err
    assert not os.path.exists(os.path.join(run, "metrics.jsonl"))


@pytest.mark.slow
def test_two_trainers_on_one_run_folder(trained, tmp_path):
    """Issue 53: the same command started twice trained two trajectories into one folder. The second start now
    stops in one line naming the first (host, pid, since when) and the first runs to its end alone."""
    run = copy_run(trained[1], tmp_path)
    first = start_python(train_args(one_rank_run(tmp_path, trained[0], run, 5)))
    try:
        lock = os.path.join(run, "run.lock")
        for _ in range(600):
            if os.path.exists(lock) and f"pid {first.pid}," in open(lock).read():  # the copy holds the fixture's
                break
            time.sleep(0.1)
        second = train(one_rank_run(tmp_path, trained[0], run, 5))
        err = one_line_refusal(second, 2)
        assert "is in use by another megaopd train" in err and f"pid {first.pid}, since" in err
        out, _ = first.communicate(timeout=900)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out[-3000:]
    assert sorted(_step_rows(run)) == [1, 2, 3, 4, 5]
    assert not any(d.startswith("old_") for d in os.listdir(os.path.join(run, "checkpoints")))


@pytest.mark.slow
def test_a_truncated_shard_of_a_checkpoint_without_manifest_names_the_file(trained, tmp_path):
    """Issue 53: without a manifest (an older megaopd's folder, a copy) a truncated shard was a bare EOFError."""
    step = str(tmp_path / "step")
    shutil.copytree(os.path.join(trained[1], "checkpoints", "step_000003"), step)
    os.remove(os.path.join(step, "manifest.json"))
    shard = os.path.join(step, "model", "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    r = _convert(step, str(tmp_path / "hf"))
    one_line_refusal(r, 2)
    assert f"{shard} is {os.path.getsize(shard)} bytes but its .metadata says it holds" in r.stderr
    assert "EOFError" not in r.stderr


@pytest.mark.slow
def test_the_converter_on_shards_and_a_config_json_that_disagree_exits_2_in_one_line(trained, tmp_path):
    """Issue 53: a 65-line traceback and exit 1 where the converter's docs promise exit 2 and one line."""
    step = str(tmp_path / "step")
    shutil.copytree(os.path.join(trained[1], "checkpoints", "step_000003"), step)
    layers = _one_layer_less_in_config(step)
    mf.write_manifest(step, mf.hash_files(step, mf.list_files(step)), mf.read_manifest(step).step)  # made to match
    r = _convert(step, str(tmp_path / "hf"))
    one_line_refusal(r, 2)
    assert f"num_hidden_layers: {layers - 1} but the shards hold {layers} layers" in r.stderr


@pytest.mark.slow
def test_sigterm_during_a_save_trains_no_further_step(trained, tmp_path):
    """Issue 53: a SIGTERM that arrived while step 4 was saved trained and saved a whole step 5 before exiting
    (the flag was read only inside the next step). Now the run stops after the save it was in."""
    run = copy_run(trained[1], tmp_path)
    saving = os.path.join(run, "checkpoints", "step_000004.tmp")
    proc = start_python(train_args(one_rank_run(tmp_path, trained[0], run, 8)))
    try:
        for _ in range(60000):  # the save of step 4 in progress (its folder under its temporary name)
            if os.path.exists(saving) or proc.poll() is not None:
                break
            time.sleep(0.005)
        assert os.path.exists(saving), "the save of step 4 was not seen"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "preemption signal received: checkpoint of step 4 saved" in out, out[-3000:]
    assert open(os.path.join(run, "checkpoints", "latest")).read() == "step_000004"
    assert sorted(_step_rows(run)) == [1, 2, 3, 4]
