"""Part d: the vocab-parallel ops at TP=2 on one device (two processes over gloo) against TP=1.

NCCL cannot put two ranks on one GPU (it refuses duplicate devices in a communicator), so the two ranks use
gloo. Gloo takes CUDA tensors only in some collectives (it stages them through host memory); the ops use
all_reduce (SUM, MAX) and, for top-k, all_gather. Each rank first probes every collective it needs with
tensors on the device and reports which ones gloo accepts; the op comparison runs when all do.
"""

from __future__ import annotations

import os
import pickle
import tempfile

import torch
import torch.distributed as dist

from megaopd.gpucheck.ops_check import BOUND, _device_results, _inputs
from megaopd.gpucheck.report import Table, max_rel

WORLD = 2
CASE = dict(scale=3.0, offset=0.0, tau=1.0, chunk=16)


def _probe(device) -> dict[str, str]:
    """Which gloo collectives accept tensors on `device`: {name: "ok" | error}."""
    out = {}
    probes = {
        "all_reduce SUM": lambda: dist.all_reduce(torch.ones(4, device=device)),
        "all_reduce MAX": lambda: dist.all_reduce(torch.ones(4, device=device), op=dist.ReduceOp.MAX),
        "all_gather": lambda: dist.all_gather(
            [torch.empty(4, device=device) for _ in range(WORLD)], torch.ones(4, device=device)
        ),
        "broadcast": lambda: dist.broadcast(torch.ones(4, device=device), src=0),
    }
    for name, fn in probes.items():
        try:
            fn()
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001 - the answer is the point
            out[name] = " ".join(f"{type(e).__name__}: {e}".split())[:160]
    return out


def _worker(rank: int, port: int, device_type: str, inp: dict, out_dir: str) -> None:
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    result: dict = {"probe": _probe(device)}
    try:
        if all(v == "ok" for v in result["probe"].values()):
            result["ops"] = _device_results(inp, CASE["tau"], CASE["chunk"], device, dist.group.WORLD, rank, WORLD)
    except Exception as e:  # noqa: BLE001 - reported in the table
        result["error"] = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def check_tp2(table: Table, device, dtypes, vocab: int, tokens: int) -> None:
    import torch.multiprocessing as mp

    from megaopd.parallel.dist import find_free_port

    for dtype_name in dtypes:
        with table.guard("d", "TP=2 gloo", dtype_name):
            inp = _inputs(tokens, vocab, CASE["scale"], CASE["offset"], getattr(torch, dtype_name), seed=20)
            tp1 = _device_results(inp, CASE["tau"], CASE["chunk"], device)
            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(
                    _worker,
                    args=(find_free_port(), device.type, inp, tmp),
                    nprocs=WORLD,
                    join=True,
                    start_method="spawn",
                )
                res = []
                for r in range(WORLD):
                    with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                        res.append(pickle.load(f))  # our own workers' files
            for name, status in res[0]["probe"].items():
                table.eq("d", f"gloo {name} on {device.type} tensors", dtype_name, "accepted", status, "ok")
            if "ops" not in res[0]:
                why = res[0].get("error") or "a collective the ops need is refused (rows above)"
                table.fail("d", "TP=2 ops", dtype_name, why)
                continue
            _, gb = BOUND[dtype_name]
            vb = 1e-5  # TP=2 vs TP=1: the same float32 math, other summation order
            for name in ("logprobs", "logsumexp", "entropy", "kl", "jsd", "gather", "support_kl", "fused"):
                ref_v, ref_gp, ref_gq = tp1[name]
                for r in range(WORLD):
                    table.le(
                        "d",
                        f"ops.{name} TP=2 rank {r} vs TP=1",
                        dtype_name,
                        "value rel",
                        max_rel(res[r]["ops"][name][0], ref_v),
                        vb,
                    )
                got_gp = torch.cat([res[r]["ops"][name][1] for r in range(WORLD)], dim=-1)
                table.le("d", f"ops.{name} TP=2 vs TP=1", dtype_name, "grad_p rel", max_rel(got_gp, ref_gp), gb)
                if ref_gq is not None:
                    got_gq = torch.cat([res[r]["ops"][name][2] for r in range(WORLD)], dim=-1)
                    table.le("d", f"ops.{name} TP=2 vs TP=1", dtype_name, "grad_q rel", max_rel(got_gq, ref_gq), gb)
            vals = res[0]["ops"]["topk"][0]
            table.le("d", "ops.topk TP=2 vs TP=1", dtype_name, "values rel", max_rel(vals, tp1["topk"][0]), vb)
