"""A checkpoint save's time before and after the manifest (megaopd.models.manifest: every file's size and
sha256, written last).

What is timed: save_model_checkpoint(model, dir, ...) of a megatron model at TP=1 on one gloo rank, end to end
(dist_checkpointing's torch_dist shards, config and metadata), with manifest=False ("before": what a save
was until the manifest) and manifest=True ("after": the same save, then every file hashed and
manifest.json written); alternated, after one warm-up save of each, median of --repeats. A training step
folder adds the optimizer's shards (Adam: 2x the fp32 weights), hashed the same way: the manifest's cost is
its bytes over the hash rate, also printed (MB/s of sha256 over the saved files).

Models: "demo" is the tiny demo's student (examples/tiny/models/student, 0.3M parameters); "medium" is a
Qwen2 shape of ~100M parameters (400 MB in float32) built here from its config alone (the weights are not
initialised: only their bytes are timed).

    python benchmarks/checkpoint_save.py                    # demo and medium, 5 repeats
    python benchmarks/checkpoint_save.py --models demo --repeats 10
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEMO = os.path.join(ROOT, "examples", "tiny", "models", "student")
MEDIUM = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, vocab_size=256, layer_types=["full_attention"] * 8)


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
    from megaopd.models.builder import build_gpt_model
    from megaopd.models.checkpoint import save_model_checkpoint
    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.manifest import hash_files, list_files
    from megaopd.parallel.groups import Layout, initialize_actor_layout

    pgs = initialize_actor_layout(Layout(1, 1))
    cfg = read_hf_config(hf_dir)
    model = build_gpt_model(cfg, 1, 1, pg_collection=pgs, dtype="float32", init_weights=False)
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
    return {"before": statistics.median(times[False]), "after": statistics.median(times[True]),
            "bytes": nbytes, "hash_s": statistics.median(hash_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="demo,medium")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    from megaopd.parallel.launch import spawn

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            r = spawn(_worker, 1, args=(model_dir(name, tmp), tmp, a.repeats), timeout=3600)[0]
            rows.append((name, r))
    print(f"{'model':8} {'MB':>8} {'before s':>9} {'after s':>9} {'after/before':>13} {'sha256 MB/s':>12}")
    for name, r in rows:
        mb = r["bytes"] / 1e6
        print(f"{name:8} {mb:8.1f} {r['before']:9.3f} {r['after']:9.3f} {r['after'] / r['before']:13.2f} "
              f"{mb / r['hash_s']:12.0f}")


if __name__ == "__main__":
    main()
