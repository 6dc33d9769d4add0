#!/usr/bin/env bash
# GPU bring-up check of issue 13: on one GPU, no download, no SGLang, no Transformer Engine, prints a table
# (check, dtype, metric, value, bound, PASS/FAIL) and exits non-zero if any row fails; with OUT set it also
# writes the table to $OUT/gpu_check.md ($OUT/gpu_bench.md for --bench).
#   a  megaopd.ops and megaopd.losses on CUDA, bf16 and fp32, vs float64 CPU references, V=152064 (~1 min);
#      every op under both implementations (rows tagged [torch] and [triton]: the Triton kernels, the default
#      on CUDA) and the Triton fused op on T x V > 2^31 bf16 logits (int64 offsets; ~13 GB)
#   b  HF transformers vs megatron logits/log-probs, Qwen2.5-1.5B shape (28 layers; --layers N for fewer),
#      random weights, fp32 (bound 1e-3) and bf16 (bound: 3x the HF bf16-vs-fp32 noise floor + 1e-2) (~1 min)
#   c  `megaopd train scripts/gpu_check/stable_opd_gpu.yaml`: 10 steps, NCCL world 1, bf16, DDP + distributed
#      optimizer, Stable-OPD, 0.5B-shaped student / 1.5B-shaped teacher (V=151936, random), embedded engine,
#      weight sync + parity probe every step, SIGKILL after the step-5 checkpoint + 1 step, restart, resume (~4-6 min)
#   d  TP=2 on the one GPU: two processes over gloo with CUDA tensors, vocab-parallel ops vs TP=1 (<1 min)
#
#   bash scripts/gpu_check.sh [--parts a,b,c,d] [--layers N]      # or: make gpu-check
#   bash scripts/gpu_check.sh --bench [loss,packing,engine,trainer] # measurements (tables, INFO rows)
#   bash scripts/gpu_check.sh --quick                              # CPU smoke mode (tiny, fp32, gloo): the CI test
#
# On the lent GPU machine (no network): first, HERE, `bash scripts/gpu_wheels.sh` (megatron-core 0.16.1,
# omegaconf, antlr4, math-verify, latex2sympy2_extended into the git-ignored .whl/, ~3 MB). Then three
# `run` calls of at most 10 minutes each, carry [".whl"], timeout_s 600, kind nvidia-h100-x1 (or whatever is lent):
#   command: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh --parts a,b,d 2>&1 | tee $OUT/log_abd.txt
#   command: (same install line); PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh --parts c 2>&1 | tee $OUT/log_c.txt; cp /tmp/megaopd_gpu_check/train_*.log $OUT/ 2>/dev/null
#   command: (same install line); PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh --bench 2>&1 | tee $OUT/log_bench.txt
# The loss kernels' speed (issue 27: naive, compiled naive, megaopd loss, fused op impl=torch / impl=triton; CUDA
# events, GB/s against the bandwidth bound), after the install line of the calls above:
#   command: (same install line); PYTHONPATH=$PWD python3 benchmarks/loss.py --device cuda 2>&1 | tee $OUT/loss_bench.txt
# All of issue 26's and 27's measurements in two calls (15 device minutes):
#   command: STEPS="engine sweep" BUDGET=400 bash scripts/gpu_session.sh   (carry [".whl"], timeout_s 600), then
#   command: STEPS="trainer tests loss" BUDGET=380 bash scripts/gpu_session.sh   (see its header)
# Measured on an H100 (2026-11-23): parts a,b,d 82 s; c 2-3 min; --bench loss 21 s, packing 32 s, engine 49 s,
# trainer ~3 min (benchmarks/README.md, section GPU).
# (the second and third calls build the models they need again when the machine is a fresh one; on a warm one
# /tmp/megaopd_gpu_check is reused). The tables come back as $OUT/gpu_check.md and $OUT/gpu_bench.md.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m megaopd.gpucheck "$@"
