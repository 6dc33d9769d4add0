#!/bin/bash
# HF -> megaopd Megatron checkpoints at the training layout (tools/convert_hf_to_megatron.py), for the
# trainer to load sharded instead of reading the HF safetensors on every rank (STUDENT_CKPT, TEACHER_CKPT).
# The conversion is one CPU process per model: no GPUs requested.
#
#   mkdir -p logs
#   MODELS_DIR=/shared/models CKPT_ROOT=/shared/ckpt sbatch slurm/convert_7b.sh
#   -> /shared/ckpt/Qwen2.5-Math-7B-tp2-pp1, /shared/ckpt/OpenThinker3-7B-tp2-pp1
#   STUDENT_CKPT=/shared/ckpt/Qwen2.5-Math-7B-tp2-pp1 TEACHER_CKPT=... sbatch slurm/stable_opd_7b.sh
#
# Environment:
#   MODELS       models to convert (names in slurm/models/), default "qwen2.5-math-7b openthinker3-7b"
#   MODELS_DIR   folder holding the HF releases (Qwen2.5-Math-7B/, ...); or HF_DIR for a single model
#   CKPT_ROOT    where the checkpoints go: CKPT_ROOT/<HF folder name>-tp<TP>-pp<PP>
#   TP, PP       the layout to write (default: each model's training layout from slurm/models/); it must
#                match the student.tp/pp (teacher.tp/pp) the training job uses
#SBATCH --job-name=convert_7b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --time=04:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue

# sbatch runs a spool copy of this file, so $0 is not in the repo: find it from MEGAOPD_ROOT, this
# file's folder (plain `bash`), or the folder sbatch was called from.
for ROOT in "${MEGAOPD_ROOT:-}" "$(dirname "$0")/.." "${SLURM_SUBMIT_DIR:-}"; do [[ -f $ROOT/slurm/common.sh ]] && break; done
[[ -f $ROOT/slurm/common.sh ]] || { echo "error: slurm/common.sh not found: submit from the megaopd checkout or set MEGAOPD_ROOT" >&2; exit 1; }
JOB_NAME="${SLURM_JOB_NAME:-convert_7b}"  # names the output folders when not under sbatch
source "$ROOT/slurm/common.sh"

require_env CKPT_ROOT "where converted checkpoints go (shared filesystem); set CKPT_ROOT=/path/to/ckpt"
# Every model's folder is checked first, so that all missing inputs are reported at once.
for name in ${MODELS:-qwen2.5-math-7b openthinker3-7b}; do
  MODEL_HF_DIR="${HF_DIR:-}" MODEL_CKPT="" MODEL_TP="" MODEL_PP=""
  load_model model "$name"
done
stop_if_missing
for name in ${MODELS:-qwen2.5-math-7b openthinker3-7b}; do
  # Each model is loaded as role "model": its folder is MODELS_DIR/<release name>, or HF_DIR when one
  # model is converted. Cleared per model so that one model's folder is never reused for the next.
  MODEL_HF_DIR="${HF_DIR:-}" MODEL_CKPT="" MODEL_TP="" MODEL_PP=""
  load_model model "$name"
  tp="${TP:-$MODEL_TP}" pp="${PP:-$MODEL_PP}"
  out="$CKPT_ROOT/$MODEL_DIRNAME-tp$tp-pp$pp"
  # Idempotent (and requeue-safe): a finished conversion is kept; the converter wants a new or empty folder.
  if [[ -e $out/config.json || -e $out/hf/config.json ]]; then note "$out exists, skipping $name"; continue; fi
  run_on_first_node "$PYTHON" "$MEGAOPD_ROOT/tools/convert_hf_to_megatron.py" \
    --hf-dir "$MODEL_HF_DIR" --out "$out" --tp "$tp" --pp "$pp"
  note "$name -> $out"
done
