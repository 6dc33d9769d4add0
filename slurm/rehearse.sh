# shellcheck shell=bash
# slurm/rehearse.sh: what a rehearsal changes, all of it, in this one file. Sourced by slurm/common.sh when
# REHEARSE=1; not run on its own. docs/cluster.md, "Rehearsing a job", says what a rehearsal proves.
#
#   sudo bash scripts/slurm_local.sh --nodes 2                  # 2 simulated 4-GPU nodes on this machine
#   REHEARSE=1 sbatch -p sim --nodes=2 slurm/stable_opd_7b.sh   # or your own cluster's partition
#
# A rehearsal is the real job: the same sbatch script, the same common.sh, the same allocation and layout
# arithmetic (nodes x GPUs per node, TP/PP/DP of student, reference and teacher, ENGINE_NODES, TEACHER_NODES),
# the same srun steps on the same nodes, ports, run folder, USR1 -> checkpoint -> requeue -> resume. Every
# command it runs is printed first, as DRY_RUN=1 prints it ([batch] / [NODE] lines). What differs, and why:
#
#   1. models   MODELS_DIR -> a folder of tiny models of each model's family, under the real models' folder
#               names (rehearse_models): examples/tiny/models (Qwen2 architecture, like Qwen2.5-Math and the 7B
#               teachers; 4 query heads and 2 KV groups, so the TP=2 layouts split them as they split the 7Bs).
#               STUDENT_HF_DIR, TEACHER_HF_DIR, STUDENT_CKPT, TEACHER_CKPT are ignored.
#   2. data     TRAIN_DATA -> examples/tiny/data/opd.jsonl; BENCH_DIR -> a folder where examples/tiny/data/val.jsonl
#               stands in for every benchmark (the jobs' validation set, math500, and eval_7b.sh's six);
#               eval_7b.sh's CKPT -> the tiny student.
#   3. device   one CPU process per GPU of the allocation (torchrun's ranks, gloo instead of NCCL), one thread
#               each; the trainer overrides REHEARSE_DEVICE (rehearse_train_args) make the GPU-only settings
#               CPU ones: float32 (megatron's bf16 optimizers take CUDA tensors), no distributed optimizer
#               (the same), no sequence parallelism (Transformer Engine's norms), and colocated engines take
#               their weights over the weight-update group instead of CUDA IPC (rollout.colocated=false).
#   4. engines  `megaopd serve` (the embedded engine behind SGLang's HTTP routes) in place of each SGLang
#               server, on the same node and port, one per engine the real job starts (rehearse_server_cmd).
#   5. size     REHEARSE_STEPS optimizer steps (3), a checkpoint every REHEARSE_SAVE_INTERVAL (1), prompts and
#               responses of tiny lengths, 4 samples of DP prompts a step, 4 validation problems
#               (REHEARSE_SIZE, rehearse_train_args); evaluation: the first 4 problems of each benchmark, 2
#               samples where the real job takes 32, 32-token answers.
# Everything else is the real launch's. tests/slurm/test_rehearse.py compares a rehearsal's printed commands with
# DRY_RUN=1's, line for line, allowing exactly these differences.

REHEARSE_STEPS="${REHEARSE_STEPS:-3}"
REHEARSE_SAVE_INTERVAL="${REHEARSE_SAVE_INTERVAL:-1}"
# Where the tiny models' folder goes: on the shared filesystem (every node reads it), beside the repo.
REHEARSE_MODELS_DIR="${REHEARSE_MODELS_DIR:-$MEGAOPD_ROOT/runs/rehearse/models}"
REHEARSE_TINY="$MEGAOPD_ROOT/examples/tiny"

# 1 + 2: the tiny models under the real folder names (a symlink each), the tiny data.
rehearse_models() {
  local f name role target
  mkdir -p "$REHEARSE_MODELS_DIR"
  for f in "$MEGAOPD_ROOT"/slurm/models/*.sh; do
    name="$(sed -n 's/^MODEL_DIRNAME=//p' "$f")"
    # Teachers are the larger tiny model (as each 7B teacher is at least its student's size); students the smaller.
    case "$(basename "$f" .sh)" in
      qwen2.5-math-*) role=student ;;
      openthinker3-7b | r1-distill-qwen-7b) role=teacher ;;
      *) continue ;;  # no tiny model of this family (Qwen3) is shipped: its jobs cannot be rehearsed yet
    esac
    target="$REHEARSE_TINY/models/$role"
    [[ -L $REHEARSE_MODELS_DIR/$name && $(readlink "$REHEARSE_MODELS_DIR/$name") == "$target" ]] \
      || ln -sfn "$target" "$REHEARSE_MODELS_DIR/$name"
  done
}
rehearse_models  # also for DRY_RUN=1: load_model checks the folders exist
export MODELS_DIR="$REHEARSE_MODELS_DIR"
unset STUDENT_HF_DIR TEACHER_HF_DIR STUDENT_CKPT TEACHER_CKPT
export TRAIN_DATA="$REHEARSE_TINY/data/opd.jsonl"
unset DATA_SOURCES
# Evaluation (eval_7b.sh): the tiny student as the checkpoint, the tiny validation set under each benchmark's
# name, the first 4 problems of each, 2 samples for the avg@N benchmarks, 32-token answers.
rehearse_benchmarks() {
  local b dir="$REHEARSE_MODELS_DIR/../bench"
  mkdir -p "$dir"
  for b in math500 minerva olympiadbench amc aime24 aime25; do
    [[ -L $dir/$b.jsonl ]] || ln -sfn "$REHEARSE_TINY/data/val.jsonl" "$dir/$b.jsonl"
  done
  BENCH_DIR="$(cd "$dir" && pwd)"
  export BENCH_DIR
}
rehearse_benchmarks
export CKPT="${REHEARSE_CKPT:-$REHEARSE_TINY/models/student}" AVG_SAMPLES=2 EVAL_MAX_NEW_TOKENS=32
# Not CKPT/eval (eval_7b.sh's default), which would be inside the repo's tiny model.
export EVAL_OUT="${EVAL_OUT:-${OUTPUT_ROOT:-$MEGAOPD_ROOT/runs/rehearse}/${JOB_NAME:-eval_7b}}"
export EVAL_ARGS="${EVAL_ARGS:+$EVAL_ARGS }--limit 4"

# 3: one thread per rank and per engine (the simulated GPUs share this machine's cores); every command printed,
# in the job's log and, whole lines each, in SHOW_COMMANDS_LOG (one file per job; a requeued run appends to it).
export OMP_NUM_THREADS=1 SHOW_COMMANDS=1
if [[ ${DRY_RUN:-0} != 1 ]]; then
  export SHOW_COMMANDS_LOG="${REHEARSE_COMMANDS_LOG:-$MEGAOPD_ROOT/runs/rehearse/commands-${SLURM_JOB_ID:-local}.log}"
  mkdir -p "$(dirname "$SHOW_COMMANDS_LOG")"
  echo "# run ${SLURM_RESTART_COUNT:-0} of job ${SLURM_JOB_ID:-local}" >>"$SHOW_COMMANDS_LOG"
fi

# 3 + 5: the trainer overrides, appended last (they win over the preset, the scripts' and the user's own).
rehearse_train_args() {
  local dp=$((WORLD_SIZE / (${STUDENT_TP:-1} * ${STUDENT_PP:-1})))
  (( dp > 0 )) || dp=1
  REHEARSE_DEVICE=(student.dtype=float32 reference.dtype=float32 teacher.dtype=float32
                   optimizer.use_distributed_optimizer=false
                   student.sequence_parallel=false reference.sequence_parallel=false teacher.sequence_parallel=false
                   rollout.colocated=false)
  REHEARSE_SIZE=(trainer.max_steps="$REHEARSE_STEPS" trainer.save_interval="$REHEARSE_SAVE_INTERVAL"
                 trainer.prompts_per_step="$dp" trainer.samples_per_prompt=4 trainer.micro_batch_size=2
                 data.max_prompt_len=128 data.max_golden_len=256 rollout.max_new_tokens=32
                 validation.max_problems=4
                 validation.max_new_tokens=32 logging.tensorboard=false)
  REHEARSE_ARGS=("${REHEARSE_DEVICE[@]}" "${REHEARSE_SIZE[@]}")
}

# 4: the server command of launch_server (cmd, an SGLang launch) -> `megaopd serve` of the same model on the
# same port; the key comes from the environment as for BACKEND=megaopd.
rehearse_server_cmd() {
  local hf_dir="$1" port="$2"
  cmd=("$PYTHON" -m megaopd.cli serve --hf-dir "$hf_dir" --host 0.0.0.0 --port "$port"
       --allowed-sync-host "$MASTER_ADDR" --num-threads 1)
}
