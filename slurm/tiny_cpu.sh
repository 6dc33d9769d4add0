#!/bin/bash
# The tiny CPU job (examples/tiny/stable_opd.yaml: a tiny model, TP=2 over 2 gloo ranks) through the same
# path as the GPU jobs: sbatch -> srun (one task per node) -> torchrun --nproc-per-node=2 -> megaopd train.
# What CI submits to the local cluster (scripts/slurm_local.sh) to prove that path end to end.
#
#   mkdir -p logs
#   RUN_DIR=/tmp/tiny sbatch slurm/tiny_cpu.sh [key=value ...]      (or OUTPUT_ROOT=...: OUTPUT_ROOT/tiny_cpu)
#   DRY_RUN=1 RUN_DIR=/tmp/tiny bash slurm/tiny_cpu.sh
#
# Environment: RUN_DIR or OUTPUT_ROOT; CONFIG (default examples/tiny/stable_opd.yaml); MAX_STEPS,
# SAVE_INTERVAL, EVAL_INTERVAL (optional).
#SBATCH --job-name=tiny_cpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@60
#SBATCH --requeue

# Two gloo ranks per node, no GPUs, whatever the environment says.
GPUS_PER_NODE=0
NPROC_PER_NODE=2
# sbatch runs a spool copy of this file, so $0 is not in the repo: find it from MEGAOPD_ROOT, this
# file's folder (plain `bash`), or the folder sbatch was called from.
for ROOT in "${MEGAOPD_ROOT:-}" "$(dirname "$0")/.." "${SLURM_SUBMIT_DIR:-}"; do [[ -f $ROOT/slurm/common.sh ]] && break; done
[[ -f $ROOT/slurm/common.sh ]] || { echo "error: slurm/common.sh not found: submit from the megaopd checkout or set MEGAOPD_ROOT" >&2; exit 1; }
JOB_NAME="${SLURM_JOB_NAME:-tiny_cpu}"  # names the output folders when not under sbatch
source "$ROOT/slurm/common.sh"

CONFIG="${CONFIG:-$MEGAOPD_ROOT/examples/tiny/stable_opd.yaml}"
require_path CONFIG "the tiny preset; set CONFIG=/path/to/preset.yaml"
setup_run_dir

OVERRIDES=(run.dir="$RUN_DIR" run.world_size="$WORLD_SIZE")
if [[ -n ${MAX_STEPS:-} ]]; then OVERRIDES+=(trainer.max_steps="$MAX_STEPS"); fi
if [[ -n ${SAVE_INTERVAL:-} ]]; then OVERRIDES+=(trainer.save_interval="$SAVE_INTERVAL"); fi
if [[ -n ${EVAL_INTERVAL:-} ]]; then OVERRIDES+=(trainer.eval_interval="$EVAL_INTERVAL"); fi
# The preset's rollout engine (embedded) is kept: the tiny model generates inside the trainer.
run_torchrun train "$CONFIG" "${OVERRIDES[@]}" "$@"
