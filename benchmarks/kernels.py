"""What the loss's Triton kernels ask of an H100, read from their compiled code on this CPU (no GPU needed).

    python benchmarks/kernels.py [--blocks 1024,2048,4096] [--warps 4,8,16] [--stages 1,2,3]

Compiles megaopd/ops/_kernels.py's stats kernel (the Stable-OPD forward: HAS_Q, WITH_XEXP, WITH_DIFF) and grad
kernel (MODE 1: reads p and q, writes dp) for sm_90 with the specialization Triton's launcher gives them at
V=152064 (pointers, sizes and strides divisible by 16), runs the ptxas triton ships with -v on the PTX, and
prints per (kernel, block, warps, stages): registers per thread, spilled bytes, shared memory, whether loads
are 16-byte vectors or cp.async prefetches, how many programs fit on one SM (the binding limit: registers,
threads, shared memory or the 32-block cap), and the bytes of logits one SM has requested per loop step:
programs x loaded bytes per block x max(1, stages - 1).

Why: a memory-bound kernel reaches the bandwidth only with enough bytes in flight per SM (Little's law:
~3.35 TB/s x ~0.7 us of latency / 132 SMs, about 18 KB, more under load); without prefetch (stages = 1) a
program's loads are in flight only between its reductions. Timings need the GPU
(`benchmarks/loss.py --device cuda --sweep`); this table says which configurations are worth timing and
why the measured ones land where they do. It is not a timing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ARCH = 90
"""The H100's compute capability: the PTX target, and the per-SM limits below (CUDA occupancy calculator):
registers, threads, resident blocks, shared memory, shared memory the driver reserves per block."""
SM_REGS, SM_THREADS, SM_BLOCKS, SM_SMEM, SMEM_PER_BLOCK = 65536, 2048, 32, 228 * 1024, 1024


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) from `ptxas -v`."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run(
            [ptxas, "-v", f"-arch=sm_{arch}a", f.name, "-o", os.devnull], capture_output=True, text=True, check=True
        )
    finally:
        os.unlink(f.name)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return int(regs.group(1)), int(spills.group(1)) if spills else 0


def programs_per_sm(regs: int, warps: int, smem: int) -> tuple[int, str]:
    """Resident programs per SM and the limit that binds (registers are allocated per warp in units of 256)."""
    per_warp = -(-regs * 32 // 256) * 256
    limits = {
        "registers": SM_REGS // (per_warp * warps),
        "threads": SM_THREADS // (32 * warps),
        "blocks": SM_BLOCKS,
        "shared memory": SM_SMEM // (smem + SMEM_PER_BLOCK),
    }
    name = min(limits, key=limits.get)
    return limits[name], name


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", default="1024,2048,4096")
    p.add_argument("--warps", default="4,8,16")
    p.add_argument("--stages", default="1,2,3")
    args = p.parse_args(argv)
    from megaopd.ops import _kernels as K
    from megaopd.ops._gpu_build import build

    kernels = {
        "stats (forward)": (K.stats_kernel, dict(HAS_Q=True, WITH_XEXP=True, WITH_DIFF=True), 2),
        "grad (backward)": (K.grad_kernel, dict(MODE=1, WRITE_P=True, WRITE_Q=False, HAS_ONEHOT=True), 2),
    }
    print(f"\nsm_{ARCH}, bf16 logits; loaded bytes per block = tensors read x block x 2\n")
    print(
        "| kernel | block | warps | stages | registers | spills | shared KiB | loads | programs / SM (limit) "
        "| KiB requested / SM / step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (fn, consts, tensors) in kernels.items():
        for block in (int(x) for x in args.blocks.split(",")):
            for warps in (int(x) for x in args.warps.split(",")):
                for stages in (int(x) for x in args.stages.split(",")):
                    kernel = build(fn, dict(consts, BLOCK=block, STAGES=stages), warps, ARCH)
                    ptx, smem = kernel.asm["ptx"], int(kernel.metadata.shared)
                    regs, spills = ptxas_usage(ptx, ARCH)
                    n, limit = programs_per_sm(regs, warps, smem)
                    loads = "cp.async" if "cp.async" in ptx else ("16 B" if "ld.global.v4" in ptx else "< 16 B")
                    kib = n * tensors * block * 2 * max(1, stages - 1) / 1024
                    print(
                        f"| {name} | {block} | {warps} | {stages} | {regs} | {spills} | {smem / 1024:.1f} | {loads} "
                        f"| {n} ({limit}) | {kib:.0f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
