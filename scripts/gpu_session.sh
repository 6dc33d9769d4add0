#!/usr/bin/env bash
# The GPU measurements of issues 26 and 27 as ONE device call (a session's device time is 15 minutes, the
# machine's start included): install the wheels carried in .whl/ (bash scripts/gpu_wheels.sh, here), then
# each step under its own time limit and one overall deadline, each step's log and table under $OUT/<step>/.
#   run: command "bash scripts/gpu_session.sh", carry [".whl"], timeout_s 600
#   STEPS="loss engine" BUDGET=300 bash scripts/gpu_session.sh   # a subset, a shorter deadline
# Every step does not fit in one call: with 15 device minutes (the machine's start included, ~1-2 of them),
# make two, the targets' measurements first:
#   call 1: STEPS="engine sweep" BUDGET=400      call 2: STEPS="trainer tests loss" BUDGET=380
# Steps (seconds each on an H100, 2026-11-27): tests (unmeasured: tests/engine with the engine on the GPU, as
# "auto" picks it there: graphs, the shared logits buffer, compile_decode, against transformers); loss 25-50
# (benchmarks/loss.py --device cuda); engine 85 before the compiled arm (bf16: the engine, the engine with
# compile_decode (its compilations unmeasured) and transformers' compiled static-cache generate, then a profile
# of each case); sweep (unmeasured: the default and 27 Triton launch configurations (block x warps x stages of
# prefetch) at T=4096, forward and backward timed apart); engine32 ~40 (float32, the engine alone);
# trainer ~120 a run (recompute=none at 8k tokens, then full); a 55 (ops and losses vs float64).
set -u
cd "$(dirname "$0")/.."
ls .whl/*.whl > /dev/null 2>&1 || { echo "gpu_session: no wheels in .whl/: run bash scripts/gpu_wheels.sh here, then carry .whl"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_session}; mkdir -p "$OUT"
END=$((SECONDS + ${BUDGET:-570}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo $l; }
G="python3 -m megaopd.gpucheck"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv | tee "$OUT/env.txt"
for step in ${STEPS:-engine sweep trainer tests loss engine32 a}; do
  mkdir -p "$OUT/$step"; t=$SECONDS
  case $step in
    tests) timeout "$(left 150)" python3 -m pytest -q -m "" -rs tests/engine ;;
    loss) timeout "$(left 90)" python3 benchmarks/loss.py --device cuda --repeats 20 ;;
    sweep) timeout "$(left 150)" python3 benchmarks/loss.py --device cuda --sweep --repeats 10 --tokens 4096 ;;
    engine) OUT=$OUT/$step timeout "$(left 240)" $G --bench engine --generators "engine,engine compiled,hf static" --dtypes bfloat16 --profile ;;
    engine32) OUT=$OUT/$step timeout "$(left 90)" $G --bench engine --generators engine --dtypes float32 ;;
    trainer) OUT=$OUT/$step timeout -k 5 "$(left 300)" $G --bench trainer --recompute none,full ;;
    a) OUT=$OUT/$step timeout "$(left 120)" $G --parts a ;;
    *) echo "unknown step $step (tests loss sweep engine engine32 trainer a)"; continue ;;
  esac > "$OUT/$step/log.txt" 2>&1
  echo "[gpu_session] $step rc=$? $((SECONDS - t)) s" | tee -a "$OUT/env.txt"
done
