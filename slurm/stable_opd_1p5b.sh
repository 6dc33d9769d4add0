#!/bin/bash
# Stable-OPD (paper 2604.08527, table 2): Qwen2.5-Math-1.5B student, DeepSeek-R1-Distill-Qwen-7B teacher
# (TEACHER=openthinker3-7b for the other setting), 64 prompts x 4 samples, temperature 1.0, Adam lr 1e-6,
# 4 H200 per node, any number of nodes. Same environment as slurm/stable_opd_7b.sh:
#
#   mkdir -p logs
#   MODELS_DIR=/shared/models TRAIN_DATA=/shared/data/opd_13k.parquet OUTPUT_ROOT=/shared/runs \
#     sbatch slurm/stable_opd_1p5b.sh [key=value ...]
#SBATCH --job-name=stable_opd_1p5b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue

# sbatch runs a spool copy of this file, so $0 is not in the repo: find it from MEGAOPD_ROOT, this
# file's folder (plain `bash`), or the folder sbatch was called from.
for ROOT in "${MEGAOPD_ROOT:-}" "$(dirname "$0")/.." "${SLURM_SUBMIT_DIR:-}"; do [[ -f $ROOT/slurm/common.sh ]] && break; done
[[ -f $ROOT/slurm/common.sh ]] || { echo "error: slurm/common.sh not found: submit from the megaopd checkout or set MEGAOPD_ROOT" >&2; exit 1; }
JOB_NAME="${SLURM_JOB_NAME:-stable_opd_1p5b}"  # names the run folder (and the log) when not under sbatch
source "$ROOT/slurm/common.sh"

(( GPUS_PER_NODE > 0 )) || die "this job trains on GPUs and got none: submit with --gpus-per-node (the tiny CPU job is slurm/tiny_cpu.sh)"
load_model student qwen2.5-math-1.5b
load_model teacher "${TEACHER:-r1-distill-qwen-7b}"
CONFIG="${CONFIG:-$MEGAOPD_ROOT/examples/paper/stable_opd_1p5b.yaml}"
require_path CONFIG "the paper preset (examples/paper/stable_opd_1p5b.yaml: the paper's settings, sized with megaopd plan); set CONFIG=/path/to/preset.yaml"
run_distillation "$@"
