#!/bin/bash
# Stable-OPD (paper 2604.08527): Qwen2.5-Math-7B student distilled on-policy from a 7B reasoning teacher,
# with golden-solution mixing and the reference KL. The paper's settings: 64 prompts x 4 samples per
# step, temperature 1.0, Adam lr 1e-6, 4 H200 per node. Any number of nodes (sbatch --nodes=N).
#
#   mkdir -p logs    # Slurm writes logs/<job name>-<job id>.out and does not create the folder
#   MODELS_DIR=/shared/models TRAIN_DATA=/shared/data/opd_13k.parquet OUTPUT_ROOT=/shared/runs \
#     sbatch --nodes=2 slurm/stable_opd_7b.sh [key=value ...]          # extra trainer overrides
#   DRY_RUN=1 DRY_RUN_NODES="node1 node2" ... bash slurm/stable_opd_7b.sh   # print the per-node commands
#
# Environment (see slurm/common.sh for the rest: ENGINE_*, NCCL_*, MASTER_PORT, MAX_STEPS, ...):
#   TEACHER         openthinker3-7b (default) | r1-distill-qwen-7b   (settings in slurm/models/)
#   MODELS_DIR      folder holding the HF releases (Qwen2.5-Math-7B/, OpenThinker3-7B/, ...), or set
#   STUDENT_HF_DIR, TEACHER_HF_DIR   each model's HF folder; STUDENT_CKPT / TEACHER_CKPT: converted
#                   checkpoints (slurm/convert_7b.sh) the trainer loads instead
#   TRAIN_DATA      prompts with golden solutions (tools/prepare_openr1_math.py), or DATA_SOURCES
#   OUTPUT_ROOT     the run folder is OUTPUT_ROOT/<job name> (or set RUN_DIR)
#   CONFIG          base preset (default examples/tiny/stable_opd.yaml: it picks the Stable-OPD loss;
#                   everything size-dependent is overridden below)
#   ENGINE_NODES    0: SGLang engines colocated on the training GPUs; N: the last N nodes serve only
#   TEACHER_NODES   0: the teacher inside the training job; N: N nodes serve it (SGLang prefill scoring)
#
# Requeue: the run folder depends on the job name only, so when the job is requeued (node failure,
# preemption, or by itself at the time limit: USR1 -> checkpoint -> `scontrol requeue`) it resumes from
# RUN_DIR/checkpoints/latest with the same data order.
#SBATCH --job-name=stable_opd_7b
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
JOB_NAME="${SLURM_JOB_NAME:-stable_opd_7b}"  # names the run folder (and the log) when not under sbatch
source "$ROOT/slurm/common.sh"

(( GPUS_PER_NODE > 0 )) || die "this job trains a 7B model on GPUs and got none: submit with --gpus-per-node (the tiny CPU job is slurm/tiny_cpu.sh)"
load_model student qwen2.5-math-7b
load_model teacher "${TEACHER:-openthinker3-7b}"
CONFIG="${CONFIG:-$MEGAOPD_ROOT/examples/paper/stable_opd_7b.yaml}"
require_path CONFIG "the paper preset (examples/paper/stable_opd_7b.yaml: the paper's settings, sized with megaopd plan); set CONFIG=/path/to/preset.yaml"
run_distillation "$@"
