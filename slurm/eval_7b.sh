#!/bin/bash
# The six-benchmark table of one or several checkpoints with the paper's protocol (2604.08527, sec. 5.1):
# pass@1 on MATH-500, Minerva and OlympiadBench; avg@32 on AMC, AIME24 and AIME25; temperature 0.6.
# Per checkpoint: one SGLang server per GPU (or per ENGINE_TP GPUs), one `megaopd eval --engines` over
# all of them for all six benchmarks, servers stopped; then one combined table, a row per checkpoint.
#
#   mkdir -p logs
#   CKPT=/shared/runs/stable_opd_7b/hf BENCH_DIR=/shared/benchmarks sbatch slurm/eval_7b.sh
#   CKPT=/shared/runs/stable_opd_7b/checkpoints BENCH_DIR=... sbatch slurm/eval_7b.sh   # every saved step
#
# Environment:
#   CKPT             an HF folder, a megaopd Megatron checkpoint (exported to HF once, into
#                    EVAL_OUT/<label>/hf), a run's checkpoints/ folder (every step_* in it, in step order),
#                    or several of these separated by commas
#   BENCH_DIR        folder of <benchmark>.jsonl files (tools/prepare_benchmarks.py)
#   EVAL_OUT         output folder (default CKPT/eval for one CKPT path; required for a list): EVAL_OUT/<label>/
#                    per checkpoint (generations.jsonl, results.md/json), EVAL_OUT/results.md the combined table
#   PASS1_BENCHMARKS (math500,minerva,olympiadbench), AVG_BENCHMARKS (amc,aime24,aime25), AVG_SAMPLES (32)
#   EVAL_TEMPERATURE, EVAL_MAX_NEW_TOKENS (3072: Qwen2.5-Math's 4096-token context minus the prompt)
#   ENGINE_TP        GPUs per SGLang server (1: one per GPU, data parallel); ENGINE_BACKEND=megaopd serves
#                    with `megaopd serve` instead (CPU tests); ENGINE_MEM_FRACTION (0.85), SGLANG_ARGS
#   EVAL_ARGS        further `megaopd eval` flags, e.g. "--limit 50"
# Resumable: a requeued or resubmitted job skips checkpoints whose results.json exists and, inside a
# checkpoint, the samples already in its generations.jsonl.
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

if [[ ${ENGINE_BACKEND:-sglang} == sglang ]]; then
  (( GPUS_PER_NODE > 0 )) || die "evaluation of a 7B model runs on GPUs and this job got none: submit with --gpus-per-node (or ENGINE_BACKEND=megaopd for a CPU test)"
fi
require_env CKPT "the checkpoint(s) to evaluate: an HF folder, a Megatron checkpoint, a run's checkpoints/ folder, or a comma-separated list; set CKPT=/path"
require_path BENCH_DIR "the folder of <benchmark>.jsonl files written by tools/prepare_benchmarks.py; set BENCH_DIR=/path"
stop_if_missing

# The checkpoints, in order: a checkpoints/ folder (neither HF nor Megatron itself) stands for its step_*.
CKPTS=()
IFS=, read -r -a _given <<<"$CKPT"
for c in "${_given[@]}"; do
  [[ -e $c ]] || die "CKPT entry $c does not exist: an HF folder, a Megatron checkpoint or a run's checkpoints/ folder"
  if [[ ! -f $c/config.json && ! -f $c/megaopd_checkpoint.json ]] && compgen -G "$c/step_*" >/dev/null; then
    for s in "$c"/step_*; do [[ $s == *.tmp ]] || CKPTS+=("$s"); done
  else
    CKPTS+=("$c")
  fi
done
(( ${#CKPTS[@]} > 0 )) || die "CKPT=$CKPT names no checkpoint"
if [[ -z ${EVAL_OUT:-} ]]; then
  (( ${#_given[@]} == 1 )) || die "EVAL_OUT is not set: with several CKPT entries, say where the table goes (EVAL_OUT=/path)"
  EVAL_OUT="${_given[0]}/eval"
fi
LOG_DIR="${LOG_DIR:-$EVAL_OUT/logs}"
_show batch mkdir -p "$LOG_DIR"
if [[ $DRY_RUN != 1 ]]; then mkdir -p "$LOG_DIR"; fi

# The table's row name: the folder's name, or run/step for `latest` and `hf` (which say nothing alone).
label_of() {
  local c="${1%/}" base
  base="$(basename "$c")"
  if [[ $base == latest && -L $c ]]; then base="$(basename "$(readlink -f "$c")")"; fi
  if [[ $base == hf || $base == latest || $base == step_* ]]; then
    local run
    run="$(basename "$(dirname "$c")")"
    [[ $run == checkpoints ]] && run="$(basename "$(dirname "$(dirname "$c")")")"
    base="$run-$base"
  fi
  printf '%s' "$base"
}

IFS=, read -r -a PASS1 <<<"${PASS1_BENCHMARKS:-math500,minerva,olympiadbench}"
IFS=, read -r -a AVG <<<"${AVG_BENCHMARKS:-amc,aime24,aime25}"
SAMPLES=()
for b in "${PASS1[@]}"; do SAMPLES+=("$b=1"); done
for b in "${AVG[@]}"; do SAMPLES+=("$b=${AVG_SAMPLES:-32}"); done
COMMON=(--benchmarks "$(_join , "${PASS1[@]}" "${AVG[@]}")" --samples "$(_join , "${SAMPLES[@]}")"
        --data-dir "$BENCH_DIR" --max-new-tokens "${EVAL_MAX_NEW_TOKENS:-3072}"
        --engine-wait 60 --engine-timeout "${EVAL_REQUEST_TIMEOUT:-7200}")
if [[ -n ${EVAL_TEMPERATURE:-} ]]; then COMMON+=(--temperature "$EVAL_TEMPERATURE"); fi
if [[ -n ${EVAL_ARGS:-} ]]; then read -r -a _extra <<<"$EVAL_ARGS"; COMMON+=("${_extra[@]}"); fi

# Evaluation owns its GPUs: no memory saver, most of the memory for the KV cache.
export ENGINE_COLOCATED=0 ENGINE_MEM_FRACTION="${ENGINE_MEM_FRACTION:-0.85}" ENGINE_TP="${ENGINE_TP:-1}"

stop_engines() {
  _show batch stop-engines "${ENGINE_URLS[@]}"
  if [[ $DRY_RUN == 1 ]]; then ENGINE_PIDS=() ENGINE_PID_URLS=(); return; fi
  local pid
  for pid in "${ENGINE_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${ENGINE_PIDS[@]}"; do _wait_pid "$pid" || true; done
  ENGINE_PIDS=() ENGINE_PID_URLS=()
}

ROWS=()
PORT_BASE="${ENGINE_PORT:-30000}"
for k in "${!CKPTS[@]}"; do
  c="${CKPTS[$k]}"
  label="$(label_of "$c")"
  out="$EVAL_OUT/$label"
  ROWS+=("$out")
  if [[ -f $out/results.json && $DRY_RUN != 1 ]]; then note "$label: done already ($out/results.json)"; continue; fi
  # A Megatron checkpoint (which also holds config.json, its HF side files) is exported to HF once.
  EVAL_HF_DIR="$c"
  if [[ -f $c/megaopd_checkpoint.json || ! -f $c/config.json ]]; then
    EVAL_HF_DIR="$out/hf"
    if [[ ! -f $EVAL_HF_DIR/config.json ]]; then
      run_on_first_node "$PYTHON" "$MEGAOPD_ROOT/tools/convert_megatron_to_hf.py" --ckpt "$c" --out "$EVAL_HF_DIR"
    fi
  fi
  # Fresh ports per checkpoint: the previous servers' sockets may linger.
  ENGINE_PORT=$((PORT_BASE + 100 * (k % 50)))
  if [[ $DRY_RUN == 1 && ! -e $EVAL_HF_DIR ]]; then
    # A dry run exports nothing: let the engine lines name the folder the export would write.
    _require_path="$(declare -f require_path)"
    require_path() { require_env "$@"; }
    start_engines EVAL_HF_DIR
    eval "$_require_path"
  else
    start_engines EVAL_HF_DIR
  fi
  cmd=("$PYTHON" -m megaopd.cli eval --ckpt "$EVAL_HF_DIR" --engines "$(_join , "${ENGINE_URLS[@]}")"
       --out "$out" --label "$label" "${COMMON[@]}")
  _show batch "${cmd[@]}"
  if [[ $DRY_RUN != 1 ]]; then "${cmd[@]}" || die "evaluation of $c failed (see above; started again, it resumes)"; fi
  stop_engines
done

table=("$PYTHON" -m megaopd.eval.table "${ROWS[@]}" --out "$EVAL_OUT")
_show batch "${table[@]}"
if [[ $DRY_RUN != 1 ]]; then "${table[@]}"; fi
note "combined table in $EVAL_OUT/results.md"
