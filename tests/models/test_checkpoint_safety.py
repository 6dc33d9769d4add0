"""Checkpoints are verified and read without running code (megaopd.models.manifest, megaopd.models.safe_load),
and a run folder's resume point, pruning and metrics.jsonl never lose or repeat work (megaopd.trainer.run_folder,
trainer.checkpoint._prune, trainer.run_log.keep_rows_through). Quick: real files and real torch DCP metadata,
no model; the end-to-end versions (converter, model paths, resume) are tests/trainer/test_run_folder_faults.py."""

import json
import os
import pickle

import pytest
import torch

from megaopd.models import manifest as mf
from megaopd.models import safe_load


class Payload:
    """What a hostile checkpoint pickles: unpickling it runs a shell command (creates the marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _folder(root, files: dict[str, bytes], step=None):
    os.makedirs(root, exist_ok=True)
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
    mf.write_manifest(root, mf.hash_files(root, mf.list_files(root)), step)
    return root


def test_manifest_names_the_flipped_truncated_missing_or_added_file(tmp_path):
    root = _folder(str(tmp_path / "ck"), {"model/__0_0.distcp": os.urandom(4096), "config.json": b"{}"}, step=3)
    assert mf.verify(root) is None and mf.read_manifest(root).step == 3
    shard = os.path.join(root, "model", "__0_0.distcp")
    good = open(shard, "rb").read()
    data = bytearray(good)
    data[1000:1008] = bytes(b ^ 0xFF for b in data[1000:1008])  # 8 flipped bytes, same size
    open(shard, "wb").write(bytes(data))
    assert "model/__0_0.distcp differs from its manifest.json" in mf.verify(root)
    open(shard, "wb").write(bytes(data[:2000]))
    assert "model/__0_0.distcp is 2000 bytes, its manifest.json says 4096" in mf.verify(root)
    os.remove(shard)
    assert "model/__0_0.distcp is missing" in mf.verify(root)
    open(shard, "wb").write(bytes(data))
    open(os.path.join(root, "model", "extra.pt"), "wb").write(b"x")
    assert "model/extra.pt is not in its manifest.json" in mf.verify(root)
    assert mf.verify(root, skip=("model",)) is None  # a model load skips what it does not read
    os.remove(os.path.join(root, "model", "extra.pt"))
    open(shard, "wb").write(good)
    os.makedirs(os.path.join(root, "eval"))
    open(os.path.join(root, "eval", "results.json"), "w").write("{}")  # `megaopd eval --ckpt` writes here
    assert mf.verify(root) is None


def test_manifest_is_written_atomically_and_a_bad_one_is_one_line(tmp_path):
    root = _folder(str(tmp_path / "ck"), {"a": b"1"})
    assert sorted(os.listdir(root)) == ["a", "manifest.json"]  # no .tmp left behind
    open(os.path.join(root, "manifest.json"), "w").write("{not json")
    with pytest.raises(mf.ManifestError, match="manifest.json is not a readable megaopd manifest"):
        mf.read_manifest(root)


def _dcp_folder(path):
    """A real torch DCP checkpoint (the format under megatron's torch_dist): .metadata is a pickle."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "obj": {"lr": 1e-3}}, checkpoint_id=path, no_dist=True)
    return path


def test_real_dcp_metadata_reads_and_a_payload_in_it_is_refused_not_run(tmp_path):
    ckpt = _dcp_folder(str(tmp_path / "model"))
    meta = safe_load.read_metadata(os.path.join(ckpt, ".metadata"))
    assert "w" in meta.state_dict_metadata
    marker = tmp_path / "pwned"
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(Payload(str(marker)), f)
    with pytest.raises(safe_load.UnsafeCheckpointError) as e:
        safe_load.check_pickles(ckpt)
    assert not marker.exists()
    msg = str(e.value)
    assert "\n" not in msg and "posix.system" in msg and os.path.join(ckpt, ".metadata") in msg


def test_payload_in_common_pt_is_refused_even_when_the_environment_turns_weights_only_off(tmp_path, monkeypatch):
    # TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (set by users to read old checkpoints) made megatron's
    # torch.load(common.pt) a plain unpickle: the payload ran. megaopd passes weights_only=True itself.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "model"
    ckpt.mkdir()
    torch.save({"optimizer": Payload(str(marker))}, ckpt / "common.pt")
    with pytest.raises(safe_load.UnsafeCheckpointError, match=r"common.pt pickles posix.system"):
        safe_load.check_pickles(str(ckpt))
    assert not marker.exists()
    torch.save({"optimizer": {"param_groups": [{"lr": 1e-3}]}, "step": torch.tensor(2.0)}, ckpt / "common.pt")
    safe_load.check_pickles(str(ckpt))  # what megatron's common state is made of still loads


# ------------------------------------------------------------------------------------------------ run folders
def _step(run, n, step=None, files=None):
    """A complete step folder (manifest recording `step`, default n) in run/checkpoints/step_{n:06d}."""
    return _folder(
        os.path.join(run, "checkpoints", f"step_{n:06d}"),
        files or {"model/__0_0.distcp": bytes([n]) * 64, "trainer_state.json": b"{}"},
        step=n if step is None else step,
    )


def _pointer(run, name):
    with open(os.path.join(run, "checkpoints", "latest"), "w") as f:
        f.write(name)


def test_lost_pointer_resumes_from_newest_complete_step_by_recorded_step(tmp_path):
    from megaopd.trainer.run_folder import resume_point

    run = str(tmp_path / "run")
    _step(run, 2)
    _step(run, 3)
    _step(run, 9, step=1)  # the name says 9, the checkpoint holds step 1
    os.makedirs(os.path.join(run, "checkpoints", "step_000004.tmp"))  # an unfinished save
    point = resume_point(run)
    assert point.path.endswith("step_000003") and point.step == 3
    assert any("latest is missing: resuming from the newest complete step" in n for n in point.notes)
    assert open(os.path.join(run, "checkpoints", "latest")).read() == "step_000003"  # healed
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == [
        "latest",
        "step_000002",
        "step_000003",
        "step_000004.tmp",
        "step_000009",
    ]  # nothing removed


def test_pointer_to_a_missing_step_falls_back_and_moves_unverified_newer_steps_aside(tmp_path):
    from megaopd.trainer.run_folder import resume_point

    run = str(tmp_path / "run")
    _step(run, 1)
    bad = _step(run, 2)
    open(os.path.join(bad, "model", "__0_0.distcp"), "ab").write(b"junk")
    _pointer(run, "step_000005")
    point = resume_point(run)
    assert point.step == 1
    assert any("names 'step_000005', which is missing or unfinished" in n for n in point.notes)
    assert any("moved step_000002" in n for n in point.notes)
    olds = [d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("old_")]
    assert len(olds) == 1 and os.listdir(os.path.join(run, "checkpoints", olds[0])) == ["step_000002"]


def test_the_planned_resume_is_the_step_the_ranks_resume(tmp_path):
    """planned_resume (`megaopd train`'s read-only look before it starts the ranks) and resume_point make one
    choice: the pointer's step, or with a stale pointer the newest step that verifies (not a newer damaged one)."""
    from megaopd.trainer.run_folder import planned_resume, resume_point

    run = str(tmp_path / "run")
    _step(run, 1)
    open(os.path.join(_step(run, 2), "model", "__0_0.distcp"), "ab").write(b"junk")
    for pointer in ("step_000005", "step_000001"):  # stale first: step 2 is still there to skip
        _pointer(run, pointer)
        path, step = planned_resume(run)
        point = resume_point(run)
        assert (path, step) == (point.path, point.step) and step == 1, pointer


def test_pointer_to_a_damaged_step_names_the_file_and_the_newest_step_that_verifies(tmp_path):
    from megaopd.trainer.run_folder import RunFolderError, resume_point

    run = str(tmp_path / "run")
    _step(run, 1)
    bad = _step(run, 2)
    shard = os.path.join(bad, "model", "__0_0.distcp")
    open(shard, "wb").write(b"\x02" * 10)  # truncated
    _pointer(run, "step_000002")
    with pytest.raises(RunFolderError) as e:
        resume_point(run)
    msg = str(e.value)
    assert "\n" not in msg and shard in msg and "is 10 bytes" in msg
    assert "newest step that verifies is" in msg and "step_000001 (step 1)" in msg
    assert "delete the pointer" not in msg  # advice that would start the run again at step 0


def test_no_step_verifies_refuses_to_start_at_zero_and_start_over_moves_everything_aside(tmp_path):
    from megaopd.trainer.run_folder import RunFolderError, resume_point

    run = str(tmp_path / "run")
    bad = _step(run, 4)
    open(os.path.join(bad, "model", "__0_0.distcp"), "wb").write(b"\x00" * 64)  # flipped, same size
    with pytest.raises(RunFolderError, match="no step folder verifies.*run.start_over=true"):
        resume_point(run)
    point = resume_point(run, start_over=True)
    assert point.path is None and point.step == 0 and "moved 1 checkpoint entries" in point.notes[0]
    (old,) = os.listdir(os.path.join(run, "checkpoints"))
    assert old.startswith("old_") and os.listdir(os.path.join(run, "checkpoints", old)) == ["step_000004"]


def test_prune_keeps_newest_by_recorded_step_and_never_what_was_just_written(tmp_path):
    from megaopd.trainer.checkpoint import _prune

    run = str(tmp_path / "run")
    for n in (1, 2, 3):
        _step(run, n)
    _step(run, 7, step=0)  # an old name with a higher number must not outrank step 3
    legacy = os.path.join(run, "checkpoints", "step_000000")
    os.makedirs(legacy)  # no manifest: not known complete, never deleted by pruning
    _prune(run, keep=2, just_written="step_000007")
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == [
        "step_000000",
        "step_000002",
        "step_000003",
        "step_000007",
    ]


def test_metrics_rows_after_the_loaded_step_move_to_a_side_file(tmp_path):
    from megaopd.trainer.run_log import keep_rows_through

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": s} for s in range(5)] + [{"step": 2, "event": "checkpoint"}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')
    notes = keep_rows_through(str(run), 2)
    kept = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [0, 1, 2, 2] and "moved 3 rows after step 2" in notes[0]
    (side,) = [p for p in os.listdir(run) if p.startswith("metrics.replaced_")]
    assert len((run / side).read_text().splitlines()) == 3  # steps 3, 4 and the cut line: kept aside
    assert keep_rows_through(str(run), 2) == []


def test_a_metrics_line_that_is_not_utf8_is_moved_aside_and_named_not_a_resume_error(tmp_path):
    """Issue 53: such a line in metrics.jsonl stopped every resume with a UnicodeDecodeError naming no file."""
    from megaopd.trainer.run_log import keep_rows_through

    run = tmp_path / "run"
    run.mkdir()
    good = b'{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n'
    (run / "metrics.jsonl").write_bytes(good + b'{"step": 3, "note": "\xff\xfe"}\n')
    notes = keep_rows_through(str(run), 2)
    assert len(notes) == 1 and f"(1 of them not readable records of {run}/metrics.jsonl)" in notes[0], notes
    assert (run / "metrics.jsonl").read_bytes() == good
    (side,) = [p for p in run.iterdir() if p.name.startswith("metrics.replaced_")]
    assert side.read_bytes() == b'{"step": 3, "note": "\xff\xfe"}\n'  # kept byte for byte
