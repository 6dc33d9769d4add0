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
# LR: the paper does not print the SFT learning rate; unset, the trainer's default applies.
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
CONFIG="${CONFIG:-$MEGAOPD_ROOT/examples/tiny/stable_opd.yaml}"
require_path CONFIG "the base preset (loss.name=sft is set below); set CONFIG=/path/to/preset.yaml"
setup_run_dir
train_base_overrides

# SFT reads no teacher (teacher.path empty: none is loaded) and generates nothing but validation.
SFT_OVERRIDES=(loss.name=sft "teacher.path=''"
               trainer.prompts_per_step="${PROMPTS_PER_STEP:-64}" trainer.samples_per_prompt=1
               rollout.engine=embedded)
if [[ -n ${LR:-} ]]; then SFT_OVERRIDES+=(optimizer.lr="$LR"); fi
run_torchrun train "$CONFIG" "${TRAIN_OVERRIDES[@]}" "${SFT_OVERRIDES[@]}" "$@"
