#!/bin/bash
# Benchmark table of a checkpoint with the paper's protocol (2604.08527, sec. 5.1): pass@1 on MATH500,
# Minerva and OlympiadBench; avg@32 on AMC, AIME24 and AIME25. One `megaopd eval` per benchmark, each on
# one GPU: Slurm runs them as parallel job steps, starting the next one whenever a GPU frees up.
#
#   mkdir -p logs
#   CKPT=/shared/runs/stable_opd_7b/checkpoints/latest BENCH_DIR=/shared/benchmarks sbatch slurm/eval_7b.sh
#
# Environment:
#   CKPT             an HF folder or a megaopd Megatron checkpoint (exported to HF once, into EVAL_OUT/hf)
#   BENCH_DIR        folder of <benchmark>.jsonl files (tools/prepare_benchmarks.py)
#   EVAL_OUT         output folder (default CKPT/eval): one sub-folder per benchmark with results.md/json
#   PASS1_BENCHMARKS (math500,minerva,olympiadbench), AVG_BENCHMARKS (amc,aime24,aime25), AVG_SAMPLES (32)
#   EVAL_TEMPERATURE, EVAL_MAX_NEW_TOKENS (3072: Qwen2.5-Math's 4096-token context minus the prompt)
#   EVAL_ARGS        further `megaopd eval` flags, e.g. "--limit 50"
#SBATCH --job-name=eval_7b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=12:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue

# sbatch runs a spool copy of this file, so $0 is not in the repo: find it from MEGAOPD_ROOT, this
# file's folder (plain `bash`), or the folder sbatch was called from.
for ROOT in "${MEGAOPD_ROOT:-}" "$(dirname "$0")/.." "${SLURM_SUBMIT_DIR:-}"; do [[ -f $ROOT/slurm/common.sh ]] && break; done
[[ -f $ROOT/slurm/common.sh ]] || { echo "error: slurm/common.sh not found: submit from the megaopd checkout or set MEGAOPD_ROOT" >&2; exit 1; }
JOB_NAME="${SLURM_JOB_NAME:-eval_7b}"  # names the output folders when not under sbatch
source "$ROOT/slurm/common.sh"

(( GPUS_PER_NODE > 0 )) || die "evaluation of a 7B model runs on GPUs and this job got none: submit with --gpus-per-node"
require_path CKPT "the checkpoint to evaluate: an HF folder or a Megatron checkpoint (e.g. RUN_DIR/checkpoints/latest); set CKPT=/path"
require_path BENCH_DIR "the folder of <benchmark>.jsonl files written by tools/prepare_benchmarks.py; set BENCH_DIR=/path"
EVAL_OUT="${EVAL_OUT:-$CKPT/eval}"
if [[ $DRY_RUN == 1 ]]; then _line batch mkdir -p "$EVAL_OUT"; else mkdir -p "$EVAL_OUT"; fi

# A Megatron checkpoint is exported to HF once here, not once per benchmark inside each eval process.
HF_DIR="$CKPT"
if [[ ! -f $CKPT/config.json ]]; then
  HF_DIR="$EVAL_OUT/hf"
  if [[ ! -f $HF_DIR/config.json ]]; then
    run_on_first_node "$PYTHON" "$MEGAOPD_ROOT/tools/convert_megatron_to_hf.py" --ckpt "$CKPT" --out "$HF_DIR"
  fi
fi

COMMON=(--data-dir "$BENCH_DIR" --max-new-tokens "${EVAL_MAX_NEW_TOKENS:-3072}" --dtype bfloat16)
if [[ -n ${EVAL_TEMPERATURE:-} ]]; then COMMON+=(--temperature "$EVAL_TEMPERATURE"); fi
if [[ -n ${EVAL_ARGS:-} ]]; then read -r -a _extra <<<"$EVAL_ARGS"; COMMON+=("${_extra[@]}"); fi

EVAL_CPUS=$((CPUS_PER_TASK / GPUS_PER_NODE)); (( EVAL_CPUS > 0 )) || EVAL_CPUS=1  # a GPU's share of the CPUs
PIDS=()
eval_one() {  # eval_one BENCHMARK SAMPLES: one GPU, one process, its own output folder
  local bench="$1" samples="$2"
  local -a cmd=("$PYTHON" -m megaopd.cli eval --ckpt "$HF_DIR" --benchmarks "$bench" --samples "$samples"
                --out "$EVAL_OUT/$bench" "${COMMON[@]}")
  # --exact with one GPU per step: steps run side by side, as many as there are GPUs; the others wait.
  local -a step=(srun --nodes=1 --ntasks=1 --gpus-per-task=1 --cpus-per-task="$EVAL_CPUS"
                 --exact --output="$EVAL_OUT/$bench.log" "${cmd[@]}")
  if [[ $DRY_RUN == 1 ]]; then _line batch "${step[@]}"; return; fi
  "${step[@]}" &
  PIDS+=("$!")
  BG_PIDS+=("$!")
}
IFS=, read -r -a PASS1 <<<"${PASS1_BENCHMARKS:-math500,minerva,olympiadbench}"
IFS=, read -r -a AVG <<<"${AVG_BENCHMARKS:-amc,aime24,aime25}"
for b in "${PASS1[@]}"; do eval_one "$b" 1; done
for b in "${AVG[@]}"; do eval_one "$b" "${AVG_SAMPLES:-32}"; done

failed=0
for pid in "${PIDS[@]}"; do _wait_pid "$pid" || failed=$((failed + 1)); done
(( failed == 0 )) || die "$failed benchmark(s) failed: see $EVAL_OUT/<benchmark>.log"
note "results in $EVAL_OUT/<benchmark>/results.md"
