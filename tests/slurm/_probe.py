"""One torchrun rank for tests/slurm: proves the sbatch -> srun -> torchrun_node.sh -> torchrun path.

    python -m tests.slurm._probe OUT_DIR [allreduce | usr1]

allreduce: gloo all_reduce of (rank + 1) over the job's ranks; each rank writes OUT_DIR/rank<R>-run<N>.json
with what it saw (ranks, node rank, master address, the sum, the environment common.sh set).
usr1: after the all_reduce, waits for SIGUSR1 (as the trainer does for a checkpoint), then exits 0; a
requeued run (OUT_DIR/checkpointed exists) reports "resumed" and exits at once.
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from megaopd.trainer.preemption import PreemptionFlag


def main() -> int:
    out, mode = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "allreduce")
    flag = PreemptionFlag(signals=(signal.SIGUSR1,))  # the trainer's; installed before anything can signal us
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    report = {
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node_rank": int(os.environ["GROUP_RANK"]),
        "master_addr": os.environ["MASTER_ADDR"],
        "master_port": os.environ["MASTER_PORT"],
        "sum": total.item(),
        "run": run,
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
    }
    marker = os.path.join(out, "checkpointed")
    if mode == "usr1":
        if os.path.exists(marker):
            report["resumed"] = True
        else:
            open(os.path.join(out, f"ready{rank}"), "w").close()
            deadline = time.time() + 240
            while flag.received is None and time.time() < deadline:
                time.sleep(0.1)
            report["usr1"] = flag.received is not None
            dist.barrier()
            if rank == 0 and flag.received is not None:
                open(marker, "w").close()
    with open(os.path.join(out, f"rank{rank}-run{run}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
