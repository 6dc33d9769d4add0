"""Runs one command and records its wall time and the peak memory of its whole process tree.

    python examples/real/measure.py --out RESULT.json -- megaopd train examples/real/sft.yaml ...

Memory: the largest sum, over every process of the tree (the command, the ranks it spawns, their helpers), of
the proportional set size (PSS, /proc/PID/smaps_rollup: a shared page counts 1/n in each of the n processes
that map it, so the sum is what the tree holds in RAM), sampled every second. Writes {"seconds", "peak_pss_gb",
"returncode"} and exits with the command's exit code.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import psutil


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def tree_pss_gb(root: psutil.Process) -> float:
    try:
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    return sum(_pss_kib(p.pid) for p in procs) * 1024 / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    start = time.time()
    proc = subprocess.Popen(cmd)
    root, peak = psutil.Process(proc.pid), 0.0
    while proc.poll() is None:
        peak = max(peak, tree_pss_gb(root))
        time.sleep(1.0)
    result = {"seconds": round(time.time() - start, 1), "peak_pss_gb": round(peak, 3), "returncode": proc.returncode}
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"[measure] {result}", flush=True)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
