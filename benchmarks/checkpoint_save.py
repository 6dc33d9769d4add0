"""A checkpoint save's time before and after the manifest (megaopd.models.manifest: every file's size and
sha256, written last).

What is timed: save_model_checkpoint(model, dir, ...) of a megatron model at TP=1 on one gloo rank, end to end
(dist_checkpointing's torch_dist shards, config and metadata), with manifest=False ("no manifest": what a
save was until the manifest) and manifest=True ("after": the same save, then every file hashed and
manifest.json written); alternated, after one warm-up save of each, median of --repeats. A training step
folder adds the optimizer's shards (Adam: 2x the fp32 weights), hashed the same way: the manifest's cost is
its bytes over the hash rate, also printed (MB/s of sha256 over the saved files).

--before TREE (a source tree of an older megaopd, e.g. a git worktree of the main before the manifest) also
times that tree's own save_model_checkpoint, the one it had before there was a manifest to skip: each round runs
one process on TREE's code, then one on this tree's (each a warm-up save, then --repeats saves of each variant),
--rounds rounds alternated, medians over all of a variant's saves. Both trees save the same model folder.

Models: "demo" is the tiny demo's student (examples/tiny/models/student, 0.3M parameters); "medium" is a
Qwen2 shape of ~100M parameters (400 MB in float32) built here from its config alone (the weights are not
initialised: only their bytes are timed).

    python benchmarks/checkpoint_save.py                    # demo and medium, 5 repeats
    python benchmarks/checkpoint_save.py --models demo --repeats 10
    python benchmarks/checkpoint_save.py --before /work/wt/before --rounds 2   # and the older tree's save
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The megaopd whose save is timed: this tree's, or --before's (set for a worker process, read again by each
# process it spawns: they import this file before their worker runs).
CODE = os.environ.get("MEGAOPD_BENCH_CODE", ROOT)
sys.path.insert(0, CODE)

DEMO = os.path.join(ROOT, "examples", "tiny", "models", "student")
MEDIUM = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=256,
    layer_types=["full_attention"] * 8,
)


def model_dir(name: str, tmp: str) -> str:
    if name == "demo":
        return DEMO
    with open(os.path.join(DEMO, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(MEDIUM)
    out = os.path.join(tmp, name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def _worker(rank, world, hf_dir, out_root, repeats):
    import inspect

    from megaopd.models.builder import BuildOptions, build_gpt_model
    from megaopd.models.checkpoint import save_model_checkpoint
    from megaopd.models.hf_config import read_hf_config
    from megaopd.parallel.groups import Layout, initialize_actor_layout

    if "manifest" not in inspect.signature(save_model_checkpoint).parameters:  # a tree from before the manifest
        return {
            "old": _old_saves(
                save_model_checkpoint,
                build_gpt_model,
                read_hf_config,
                Layout,
                initialize_actor_layout,
                hf_dir,
                out_root,
                repeats,
            )
        }
    from megaopd.models.manifest import hash_files, list_files

    pgs = initialize_actor_layout(Layout(1, 1))
    cfg = read_hf_config(hf_dir)
    model = build_gpt_model(cfg, Layout(), pgs, BuildOptions(dtype="float32", init_weights=False))
    side = hf_dir if os.path.exists(os.path.join(hf_dir, "tokenizer.json")) else None
    times = {False: [], True: []}
    nbytes, hash_s = 0, []
    for i in range(repeats + 1):  # the first of each: warm-up (megatron's writer start, page cache)
        for manifest in (False, True):
            d = os.path.join(out_root, f"ckpt_{manifest}_{i}")
            t0 = time.perf_counter()
            save_model_checkpoint(model, d, cfg, pgs, hf_side_dir=side, manifest=manifest)
            if i:
                times[manifest].append(time.perf_counter() - t0)
            if manifest and i:
                files = list_files(d)
                nbytes = sum(os.path.getsize(os.path.join(d, f)) for f in files)
                t0 = time.perf_counter()
                hash_files(d, files)
                hash_s.append(time.perf_counter() - t0)
            shutil.rmtree(d)
    return {"before": times[False], "after": times[True], "bytes": nbytes, "hash_s": hash_s}


def _old_saves(
    save_model_checkpoint, build_gpt_model, read_hf_config, Layout, initialize_actor_layout, hf_dir, out_root, repeats
) -> list[float]:
    """An older tree's save, timed as _worker times this tree's (its functions passed in: they are its own)."""
    pgs = initialize_actor_layout(Layout(1, 1))
    cfg = read_hf_config(hf_dir)
    model = build_gpt_model(cfg, 1, 1, pg_collection=pgs, dtype="float32", init_weights=False)  # the old API
    side = hf_dir if os.path.exists(os.path.join(hf_dir, "tokenizer.json")) else None
    times = []
    for i in range(repeats + 1):
        d = os.path.join(out_root, f"ckpt_old_{i}")
        t0 = time.perf_counter()
        save_model_checkpoint(model, d, cfg, pgs, hf_side_dir=side)
        if i:
            times.append(time.perf_counter() - t0)
        shutil.rmtree(d)
    return times


def _one_process(code: str, hf_dir: str, tmp: str, repeats: int) -> dict:
    """_worker run on `code`'s megaopd in a fresh interpreter (two trees' megaopd cannot share one process)."""
    out = os.path.join(tmp, "result.json")
    env = {**os.environ, "MEGAOPD_BENCH_CODE": code, "PYTHONPATH": code}
    # cwd=code: the forkserver's interpreter puts its working directory first on sys.path
    subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", hf_dir, tmp, str(repeats), out],
        env=env,
        cwd=code,
        check=True,
        timeout=3600,
    )
    with open(out) as f:
        return json.load(f)


def _worker_main(hf_dir: str, tmp: str, repeats: str, out: str) -> None:
    from megaopd.parallel.launch import spawn

    r = spawn(_worker, 1, args=(hf_dir, tmp, int(repeats)), timeout=3600)[0]
    with open(out, "w") as f:
        json.dump(r, f)


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return _worker_main(*sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="demo,medium")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--before", default=None, help="an older megaopd source tree whose save is timed too")
    ap.add_argument("--rounds", type=int, default=2, help="with --before: alternated processes of each tree")
    a = ap.parse_args()
    med = statistics.median

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            hf_dir = model_dir(name, tmp)
            runs = {"old": [], "before": [], "after": [], "hash_s": [], "bytes": 0}
            for _ in range(a.rounds if a.before else 1):
                if a.before:
                    runs["old"] += _one_process(os.path.abspath(a.before), hf_dir, tmp, a.repeats)["old"]
                r = _one_process(ROOT, hf_dir, tmp, a.repeats)
                for k in ("before", "after", "hash_s"):
                    runs[k] += r[k]
                runs["bytes"] = r["bytes"]
            rows.append((name, runs))
    print(
        f"{'model':8} {'MB':>8} {'old tree s':>11} {'no manifest s':>14} {'after s':>9} {'after/no manifest':>18} "
        f"{'after/old tree':>15} {'sha256 MB/s':>12}"
    )
    for name, r in rows:
        mb = r["bytes"] / 1e6
        old = f"{med(r['old']):11.3f}" if r["old"] else f"{'-':>11}"
        vs_old = f"{med(r['after']) / med(r['old']):15.2f}" if r["old"] else f"{'-':>15}"
        print(
            f"{name:8} {mb:8.1f} {old} {med(r['before']):14.3f} {med(r['after']):9.3f} "
            f"{med(r['after']) / med(r['before']):18.2f} {vs_old} {mb / med(r['hash_s']):12.0f}"
        )
    print(
        "saves per variant: "
        + ", ".join(f"{name} {len(r['after'])}" for name, r in rows)
        + "; medians; old tree: --before's own save_model_checkpoint"
    )


if __name__ == "__main__":
    main()
