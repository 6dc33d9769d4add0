"""Bytes and seconds per weight sync of a LoRA student, rollout.lora_sync adapter vs merged (megaopd.sync.WeightSync,
issue 55), into the embedded engine (in process) and into a `megaopd serve` process (served: the base over the
weight-update group, the adapter through POST /load_lora_adapter, megaopd.sync.http_lora): the adapter mode's first
push (the base, then the adapter), its steady pushes (the adapter alone) and a merged push (every weight, adapters
merged in float32). TP=1, float32, the tiny demo student (examples/tiny/models/student, hidden 96, 3 layers) at the
preset's rank 16 on all linears (examples/tiny/lora_opd.yaml) and at rank 4; a table on stdout. Bytes are the
tensors' (the served adapter travels as base64, 4/3 of them, in JSON). Seconds: the median of --repeats pushes (the
engine's merge, and served, the HTTP round trip included), on a shared machine: read the bytes, which do not depend
on the load.

    PYTHONPATH=. python benchmarks/lora_sync.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the spawned worker imports this file, then megaopd from this checkout

STUDENT = os.path.join(ROOT, "examples", "tiny", "models", "student")


def _worker(rank, world, hf_dir, ranks, repeats, url):
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.models.config import LoRAConfig, StudentConfig
    from megaopd.models.lora import adapter_parameters
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.rollout.build import build_engine
    from megaopd.rollout.config import RolloutConfig
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.sync import WeightSync
    from megaopd.trainer.roles import load_role_model

    pgs = initialize_actor_layout(Layout(1))
    rows = []
    for r in ranks:
        lora = LoRAConfig(enabled=True, rank=r, alpha=2.0 * r, targets=["all"])
        actor = load_role_model(StudentConfig(path=hf_dir, lora=lora), pgs, trainable=True, seed=1)
        for p in adapter_parameters(actor.model):
            p.data.normal_(0.0, 0.02)  # a trained adapter (B != 0), so the merge does real work
        for where, mode in (("", "adapter"), ("", "merged"), ("served ", "adapter"), ("served ", "merged")):
            if where:
                rollout = RolloutConfig(engine="remote", urls=[url], lora_sync=mode)
                engine = build_engine(rollout, hf_dir)
            else:
                rollout = RolloutConfig(lora_sync=mode)
                engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=hf_dir, max_batch_size=4, load_tokenizer=False))
            sync = WeightSync(engine, rollout, rank)
            pushes = [sync.push(actor.model, actor.hf, pgs, weight_version=str(v)) for v in range(repeats + 1)]
            sync.close()
            first, steady = pushes[0], pushes[1:]
            if mode == "adapter":
                what = f"{where}adapter, first push (base + adapter)"
                rows.append((r, what, first.tensors, first.bytes, first.seconds))
            rows.append(
                (
                    r,
                    f"{where}{mode}, each push ({'+'.join(first.transports)})",
                    steady[0].tensors,
                    steady[0].bytes,
                    statistics.median(s.seconds for s in steady),
                )
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default=STUDENT)
    args = ap.parse_args()
    from megaopd.parallel.dist import find_free_port
    from megaopd.parallel.launch import spawn
    from megaopd.serving.sglang_launcher import ServerProcess, megaopd_serve_command

    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    command = megaopd_serve_command(args.model, port, extra_args=["--num-threads", "1"])
    with ServerProcess.start(command, url=url, startup_timeout_s=180):
        rows = spawn(_worker, 1, args=(args.model, (16, 4), args.repeats, url), timeout=1800)[0]
    merged = {r: b for r, what, _, b, _ in rows if what.startswith("merged")}
    print("| rank | sync | tensors | bytes | of merged | seconds (median) |")
    print("|---:|---|---:|---:|---:|---:|")
    for r, what, tensors, nbytes, seconds in rows:
        print(f"| {r} | {what} | {tensors} | {nbytes:,} | {nbytes / merged[r]:.1%} | {seconds:.4f} |")


if __name__ == "__main__":
    main()
