"""Bytes and seconds per weight sync of a LoRA student into the embedded engine, rollout.lora_sync adapter vs merged
(megaopd.sync.WeightSync, issue 55): the adapter mode's first push (the base, then the adapter), its steady pushes
(the adapter alone) and a merged push (every weight, adapters merged in float32). One process, TP=1, float32, the
tiny demo student (examples/tiny/models/student, hidden 96, 3 layers) at the preset's rank 16 on all linears
(examples/tiny/lora_opd.yaml) and at rank 4; a table on stdout. Seconds: the median of --repeats pushes (the
engine's merge included), on a shared machine: read the bytes, which do not depend on the load.

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


def _worker(rank, world, hf_dir, ranks, repeats):
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.models.config import LoRAConfig, StudentConfig
    from megaopd.models.lora import adapter_parameters
    from megaopd.parallel.groups import Layout, initialize_actor_layout
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
        for mode in ("adapter", "merged"):
            engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=hf_dir, max_batch_size=4, load_tokenizer=False))
            sync = WeightSync(engine, RolloutConfig(lora_sync=mode), rank)
            pushes = [sync.push(actor.model, actor.hf, pgs, weight_version=str(v)) for v in range(repeats + 1)]
            sync.close()
            first, steady = pushes[0], pushes[1:]
            if mode == "adapter":
                rows.append((r, "adapter, first push (base + adapter)", first.tensors, first.bytes, first.seconds))
            rows.append(
                (
                    r,
                    f"{mode}, each push",
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
    from megaopd.parallel.launch import spawn

    rows = spawn(_worker, 1, args=(args.model, (16, 4), args.repeats), timeout=1800)[0]
    merged = {r: b for r, what, _, b, _ in rows if what.startswith("merged")}
    print("| rank | sync | tensors | bytes | of merged | seconds (median) |")
    print("|---:|---|---:|---:|---:|---:|")
    for r, what, tensors, nbytes, seconds in rows:
        print(f"| {r} | {what} | {tensors} | {nbytes:,} | {nbytes / merged[r]:.1%} | {seconds:.4f} |")


if __name__ == "__main__":
    main()
