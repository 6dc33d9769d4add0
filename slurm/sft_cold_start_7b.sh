#!/bin/bash
# Off-policy cold start before OPD (paper 2604.08527, sec. 5.1: SFT on 33k golden solutions, then OPD on
# the other 13k prompts): the SFT loss alone on golden data, no rollouts, no teacher.
#
#   mkdir -p logs
#   MODELS_DIR=/shared/models TRAIN_DATA=/shared/data/sft_33k.parquet OUTPUT_ROOT=/shared/runs \
#     sbatch slurm/sft_cold_start_7b.sh [key=value ...]
# Then export the result for the engines and start OPD from it:
#   python tools/convert_megatron_to_hf.py --ckpt $OUTPUT_ROOT/sft_cold_start_7b/checkpoints/latest --out /shared/models/sft7b-hf
#   STUDENT_HF_DIR=/shared/models/sft7b-hf sbatch slurm/stable_opd_7b.sh
# LR: the paper does not print the SFT learning rate; the preset uses 1e-6 (ours).
#SBATCH --job-name=sft_cold_start_7b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue

# sbatch runs a spool copy of this file, so $0 is not in the repo: find it from MEGAOPD_ROOT, this
# file's folder (plain `bash`), or the folder sbatch was called from.
for ROOT in "${MEGAOPD_ROOT:-}" "$(dirname "$0")/.." "${SLURM_SUBMIT_DIR:-}"; do [[ -f $ROOT/slurm/common.sh ]] && break; done
[[ -f $ROOT/slurm/common.sh ]] || { echo "error: slurm/common.sh not found: submit from the megaopd checkout or set MEGAOPD_ROOT" >&2; exit 1; }
JOB_NAME="${SLURM_JOB_NAME:-sft_cold_start_7b}"  # names the run folder (and the log) when not under sbatch
source "$ROOT/slurm/common.sh"

(( GPUS_PER_NODE > 0 )) || die "this job trains a 7B model on GPUs and got none: submit with --gpus-per-node (the tiny CPU job is slurm/tiny_cpu.sh)"
load_model student qwen2.5-math-7b
CONFIG="${CONFIG:-$MEGAOPD_ROOT/examples/paper/sft_cold_start_7b.yaml}"
require_path CONFIG "the paper preset (examples/paper/sft_cold_start_7b.yaml: the paper's settings, sized with megaopd plan); set CONFIG=/path/to/preset.yaml"
setup_run_dir
train_base_overrides

# The preset holds the SFT settings (loss.name=sft, no teacher, no rollouts); PROMPTS_PER_STEP and LR
# override them when set.
SFT_OVERRIDES=()
if [[ -n ${PROMPTS_PER_STEP:-} ]]; then SFT_OVERRIDES+=(trainer.prompts_per_step="$PROMPTS_PER_STEP"); fi
if [[ -n ${LR:-} ]]; then SFT_OVERRIDES+=(optimizer.lr="$LR"); fi
ARGS=(train "$CONFIG" "${TRAIN_OVERRIDES[@]}" "${SFT_OVERRIDES[@]}" "$@")
check_trainer "${ARGS[@]}"  # the trainer's config, before anything starts
start_signal_timer
run_torchrun "${ARGS[@]}"
