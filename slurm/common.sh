# shellcheck shell=bash
# slurm/common.sh: sourced by every sbatch script in slurm/. Not run on its own.
#
# What it gives a script (after `source "$ROOT/slurm/common.sh"`):
#   NODES (array), NNODES, MASTER_ADDR (= first node), MASTER_PORT, GPUS_PER_NODE, CPUS_PER_TASK, JOB_NAME
#   require_env VAR "what it is / how to set it"     records one error line when VAR is unset or empty
#   require_path VAR "what it is / how to set it"    ... or when the path it names does not exist
#   stop_if_missing           prints every recorded line and exits 1 (check_config and the scripts call it)
#   load_model ROLE NAME      per-model settings from slurm/models/NAME.sh into ROLE_* (STUDENT_TP, ...)
#   setup_run_dir             RUN_DIR (fixed per job name, so a requeued job resumes), LOG_DIR
#   start_engines HF_DIR      SGLang servers per node (colocated or ENGINE_NODES dedicated), wait for /health
#   run_torchrun ARGS...      one srun task per training node running torchrun ... -m megaopd.cli ARGS
#   run_on_first_node ARGS... one srun task on the first node (conversion, evaluation)
#
# DRY_RUN=1 prints, for each node of the allocation, the exact commands it would run instead of running
# them; DRY_RUN_NODES="node1 node2" fakes the allocation, so a 2-node launch can be checked anywhere:
#   DRY_RUN=1 DRY_RUN_NODES="node1 node2" bash slurm/stable_opd_7b.sh
# Lines are "[batch] ..." for what the batch shell runs and "[NODE] ..." for what runs on NODE.

set -euo pipefail

die() { echo "megaopd slurm: error: $*" >&2; exit 1; }
note() { echo "megaopd slurm: $*" >&2; }

# require_env VAR "what it is and how to set it": every input of a job comes from the environment; a
# missing one must fail in seconds at submission time, not after an hour in the queue and model loading.
# Each missing input is one error line, all of them at once (a user fixes them in one go, not one per try):
# require_env and require_path record the line and go on; stop_if_missing prints them and exits 1. The
# code between them reads these variables as ${VAR:-} (set -u).
MISSING=()
declare -A _MISSING_VARS=()
require_env() {
  local var="$1" what="$2"
  [[ -n ${!var:-} ]] || _missing "$var=" "$var is not set: $what"
}

# require_path VAR "what": like require_env, and the path must exist (on the shared filesystem: the batch
# shell runs on the first node, and every node reads the same paths).
require_path() {
  local var="$1" what="$2"
  if [[ -z ${!var:-} ]]; then _missing "$var=" "$var is not set: $what"
  elif [[ ! -e ${!var} ]]; then _missing "$var=${!var}" "$var=${!var} does not exist: $what"
  fi
}

# One line per variable and value: a second check of the same one (start_engines after load_model) adds none.
_missing() {
  [[ -z ${_MISSING_VARS[$1]:-} ]] || return 0
  _MISSING_VARS[$1]=1
  MISSING+=("$2")
}

# stop_if_missing: the recorded inputs, one error line each, then exit 1; nothing has started yet.
stop_if_missing() {
  (( ${#MISSING[@]} == 0 )) && return 0
  local m
  for m in "${MISSING[@]}"; do echo "megaopd slurm: error: $m" >&2; done
  exit 1
}

DRY_RUN="${DRY_RUN:-0}"
# The repo: every node runs the same checkout from the shared filesystem.
MEGAOPD_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export MEGAOPD_ROOT
PYTHON="${PYTHON:-python3}"
TORCHRUN="${TORCHRUN:-torchrun}"
# REHEARSE=1: the same job on CPU with tiny models of the same families (docs/cluster.md, "Rehearsing a job").
# Everything a rehearsal changes is in slurm/rehearse.sh; here are only its three hooks (rehearse_*).
REHEARSE="${REHEARSE:-0}"
if [[ $REHEARSE == 1 ]]; then
  # shellcheck source=slurm/rehearse.sh
  source "$MEGAOPD_ROOT/slurm/rehearse.sh"
fi

# ---------------------------------------------------------------------------------------------------------
# The allocation: nodes, master, GPUs, CPUs.
# ---------------------------------------------------------------------------------------------------------
if [[ -n ${DRY_RUN_NODES:-} ]]; then
  [[ $DRY_RUN == 1 ]] || die "DRY_RUN_NODES fakes an allocation and is only honored with DRY_RUN=1"
  read -r -a NODES <<<"$DRY_RUN_NODES"
  MASTER_ADDR="${NODES[0]}"
elif [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
  # Slurm gives a compressed list (node[01-04]); scontrol expands it in allocation order, the order srun
  # numbers nodes in (SLURM_NODEID), so the first host is node rank 0 and hosts the rendezvous.
  mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
elif [[ $DRY_RUN == 1 ]]; then
  NODES=("$(hostname -s)")
  MASTER_ADDR="${NODES[0]}"
else
  die "not inside a Slurm allocation (SLURM_JOB_NODELIST is unset): submit with sbatch, or preview the commands with DRY_RUN=1 DRY_RUN_NODES=\"node1 node2\" bash $0"
fi
NNODES="${#NODES[@]}"
export MASTER_ADDR

# One port per job, so two jobs that share a node (or a requeued job whose old sockets linger in TIME_WAIT)
# do not collide on the rendezvous port.
# Kept in 20000-28999, below the engines' ports (ENGINE_PORT, 30000 and up); 29500 (torch's default) outside a job.
# A requeued job keeps its id: shift by the restart count so it never waits on (or collides with) the
# previous run's rendezvous socket.
if [[ -n ${SLURM_JOB_ID:-} ]]; then
  MASTER_PORT="${MASTER_PORT:-$((20000 + (SLURM_JOB_ID + 997 * ${SLURM_RESTART_COUNT:-0}) % 9000))}"
else
  MASTER_PORT="${MASTER_PORT:-29500}"
fi
export MASTER_PORT

# GPUs per node: an explicit GPUS_PER_NODE wins; else what Slurm granted (SLURM_GPUS_ON_NODE, or the
# --gpus-per-node request, which may carry a type: "h200:4"); a dry run assumes the 4-GPU nodes the
# scripts request; a job without GPUs gets 0 (CPU).
if [[ -z ${GPUS_PER_NODE:-} ]]; then
  if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then GPUS_PER_NODE="$SLURM_GPUS_ON_NODE"
  elif [[ -n ${SLURM_GPUS_PER_NODE:-} ]]; then GPUS_PER_NODE="${SLURM_GPUS_PER_NODE##*:}"
  elif [[ $DRY_RUN == 1 ]]; then GPUS_PER_NODE=4
  else GPUS_PER_NODE=0
  fi
fi
# CPUs of the one task per node; passed to every srun explicitly, since srun (Slurm 22.05+) does not inherit
# the job's --cpus-per-task and a step would otherwise get one CPU per task where task binding is on.
CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"  # nproc alone reports OMP_NUM_THREADS
JOB_NAME="${JOB_NAME:-${SLURM_JOB_NAME:-megaopd}}"

# ---------------------------------------------------------------------------------------------------------
# Environment of the training and engine processes (exported, so srun carries it to every node).
# Each value is a default: a variable already set in the submitting shell wins.
# ---------------------------------------------------------------------------------------------------------
# Megatron's tensor-parallel communication overlap relies on kernels leaving the GPU in the order they
# were issued; one hardware work queue per device guarantees that (megatron asserts it for sequence
# parallelism).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# A collective that fails or times out on one rank aborts that process instead of leaving every other
# rank blocked forever: torchrun then exits non-zero and Slurm frees the nodes (and requeues, if asked).
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# Rollout lengths change every step; expandable segments let the caching allocator grow blocks in place
# instead of fragmenting memory into unusable pieces (the usual cause of OOM after hours of OPD).
# Not given to the SGLang engines: see start_engines.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# NCCL: use InfiniBand when the nodes have it. NCCL_IB_HCA (e.g. mlx5) and NCCL_IB_GID_INDEX (3 on RoCE)
# are site facts: set them in the submitting shell when NCCL's own choice is wrong. A longer IB
# retransmission timeout rides out transient fabric congestion at scale instead of failing the job.
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-0}"
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# The interface for NCCL's and gloo's TCP bootstrap: unset lets them pick the first non-loopback one,
# which is wrong on nodes whose first interface is not routable between nodes; then set, e.g.,
# NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0 (or a "^docker,lo" exclusion list).
for _var in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_HCA NCCL_IB_GID_INDEX; do
  if [[ -n ${!_var:-} ]]; then export "${_var?}"; fi
done
# Compute nodes usually have no internet: every model is a local path, so never wait on the Hub.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
# Tokenizer threads forked into data workers deadlock; the trainer tokenizes in its own threads.
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
export PYTHONUNBUFFERED=1  # log lines reach logs/%x-%j.out as they happen, not when a buffer fills

# ---------------------------------------------------------------------------------------------------------
# Printing and running commands (DRY_RUN aware).
# ---------------------------------------------------------------------------------------------------------
# shellcheck source=slurm/print.sh
source "$MEGAOPD_ROOT/slurm/print.sh"

# ---------------------------------------------------------------------------------------------------------
# Models: slurm/models/NAME.sh sets MODEL_* (HF id for documentation, directory name, default layout);
# load_model copies them into ROLE_* and resolves the paths, each overridable from the environment.
# ---------------------------------------------------------------------------------------------------------
load_model() {
  local role="$1" name="$2" file ROLE
  file="$MEGAOPD_ROOT/slurm/models/$name.sh"
  [[ -f $file ]] || die "no model settings for '$name' ($file): choose one of: $(cd "$MEGAOPD_ROOT/slurm/models" && ls ./*.sh | sed 's|^\./||; s|\.sh$||' | tr '\n' ' ')"
  MODEL_MAX_NEW_TOKENS=""
  MODEL_EP=1  # expert parallelism: only MoE settings (slurm/models/qwen3-30b-a3b.sh) set it
  # shellcheck source=/dev/null
  source "$file"
  ROLE="${role^^}"
  printf -v "${ROLE}_NAME" '%s' "$name"
  printf -v "${ROLE}_HF_ID" '%s' "$MODEL_HF_ID"
  # Layout: an explicit STUDENT_TP / TEACHER_PP ... wins over the model's default.
  local v
  for v in TP PP EP ENGINE_TP MAX_NEW_TOKENS; do
    local cur="${ROLE}_$v" def="MODEL_$v"
    [[ -n ${!cur:-} ]] || printf -v "$cur" '%s' "${!def}"
  done
  # HF directory: STUDENT_HF_DIR, else MODELS_DIR/<directory name of the HF release>.
  local hf="${ROLE}_HF_DIR" ck="${ROLE}_CKPT"
  if [[ -z ${!hf:-} && -n ${MODELS_DIR:-} ]]; then printf -v "$hf" '%s' "$MODELS_DIR/$MODEL_DIRNAME"; fi
  # What the trainer loads: a converted Megatron checkpoint (slurm/convert_7b.sh; sharded, faster to
  # load) when ROLE_CKPT is set, else the HF directory itself.
  if [[ -n ${!ck:-} ]]; then
    require_path "$ck" "the $role's weights for the trainer: a checkpoint written by slurm/convert_7b.sh (tools/convert_hf_to_megatron.py) or an HF directory; unset $ck to load $hf"
  else
    require_path "$hf" "$(hf_dir_hint "$role" "$hf")"
    printf -v "$ck" '%s' "${!hf:-}"
  fi
}

# The error text for a missing HF directory: what it is and the two ways to point at it.
hf_dir_hint() {
  local role="$1" var="$2"
  echo "the $role's Hugging Face directory ($MODEL_HF_ID: config.json, *.safetensors, tokenizer) on the shared filesystem; set $var=/path/to/$MODEL_DIRNAME, or MODELS_DIR=/path/to/models holding $MODEL_DIRNAME/ (download once: huggingface-cli download $MODEL_HF_ID --local-dir \$MODELS_DIR/$MODEL_DIRNAME)"
}

# ---------------------------------------------------------------------------------------------------------
# The run folder. It is derived from the job name, not the job id: a requeued job (same name, same id)
# or a resubmission with the same name finds RUN_DIR/checkpoints/latest and resumes from it.
# ---------------------------------------------------------------------------------------------------------
setup_run_dir() {
  if [[ -z ${RUN_DIR:-} ]]; then
    require_env OUTPUT_ROOT "where run folders go (shared filesystem); set OUTPUT_ROOT=/path/to/runs (the run folder is OUTPUT_ROOT/<job name>), or RUN_DIR=/path/to/one/run"
    RUN_DIR="${OUTPUT_ROOT:-}/$JOB_NAME"
  fi
  LOG_DIR="${LOG_DIR:-$RUN_DIR/logs}"
}

# make_run_dir: creates RUN_DIR and LOG_DIR, once the trainer's config is known good (check_config): a refused
# job leaves nothing on disk.
make_run_dir() {
  [[ -z ${_RUN_DIR_MADE:-} ]] || return 0
  _RUN_DIR_MADE=1
  _show batch mkdir -p "$RUN_DIR" "$LOG_DIR"
  if [[ $DRY_RUN != 1 ]]; then
    mkdir -p "$RUN_DIR" "$LOG_DIR" || die "cannot create RUN_DIR=$RUN_DIR or LOG_DIR=$LOG_DIR: check the path and permissions"
  fi
  note "run folder $RUN_DIR (resumes from $RUN_DIR/checkpoints/latest when present)"
}

# ---------------------------------------------------------------------------------------------------------
# Node roles. ENGINE_NODES=N gives the last N nodes to rollout engines only; training uses the others.
# ENGINE_NODES=0 (default) colocates one set of engines with the trainer on every training node.
# ---------------------------------------------------------------------------------------------------------
# TEACHER_NODES=N gives the N nodes before those to teacher servers (SGLang scoring the responses by prefill;
# teacher.engine=remote): for teachers too large to sit beside the student. Layout of an allocation:
#   [ training nodes | TEACHER_NODES teacher servers | ENGINE_NODES rollout engines ]
ENGINE_NODES="${ENGINE_NODES:-0}"
TEACHER_NODES="${TEACHER_NODES:-0}"
[[ $ENGINE_NODES =~ ^[0-9]+$ ]] || die "ENGINE_NODES=$ENGINE_NODES must be a number of nodes (0 = colocated engines)"
[[ $TEACHER_NODES =~ ^[0-9]+$ ]] || die "TEACHER_NODES=$TEACHER_NODES must be a number of nodes (0 = the teacher in the training job)"
(( ENGINE_NODES + TEACHER_NODES < NNODES )) || die "ENGINE_NODES=$ENGINE_NODES with TEACHER_NODES=$TEACHER_NODES leaves no node for training in a $NNODES-node allocation: request more nodes (sbatch --nodes=$((ENGINE_NODES + TEACHER_NODES + 1))) or lower them"
TRAIN_NODES=("${NODES[@]:0:NNODES-ENGINE_NODES-TEACHER_NODES}")
TRAIN_NNODES="${#TRAIN_NODES[@]}"
TEACHER_SERVE_NODES=("${NODES[@]:TRAIN_NNODES:TEACHER_NODES}")
if (( ENGINE_NODES > 0 )); then SERVE_NODES=("${NODES[@]:TRAIN_NNODES+TEACHER_NODES}"); else SERVE_NODES=("${TRAIN_NODES[@]}"); fi
# Ranks per training node: one per GPU; on CPU jobs the script sets NPROC_PER_NODE (gloo workers).
NPROC_PER_NODE="${NPROC_PER_NODE:-$GPUS_PER_NODE}"
WORLD_SIZE=$((TRAIN_NNODES * NPROC_PER_NODE))

_join() { local IFS="$1"; shift; printf '%s' "$*"; }

# ---------------------------------------------------------------------------------------------------------
# Background steps (engines, training) are stopped when the batch shell exits, however it exits.
# ---------------------------------------------------------------------------------------------------------
BG_PIDS=()
_cleanup() {
  local rc=$? pid
  for pid in "${BG_PIDS[@]}"; do
    # srun forwards SIGTERM to its step's tasks on every node and exits when they are gone.
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${BG_PIDS[@]}"; do
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    # Still there after 30 s: SIGKILL the srun; Slurm then kills the rest of its step.
    kill -KILL "$pid" 2>/dev/null || true
  done
  return "$rc"
}
trap _cleanup EXIT

# Preemption and time limit. The scripts ask for --signal=B:USR1@120: Slurm signals only this batch shell
# two minutes before the time limit (without B:, it would signal every process of every step, and the
# SGLang servers and torchrun itself die on USR1). The shell passes USR1 to the training step; the
# trainer checkpoints and exits 0; then the job requeues itself and resumes from that checkpoint.
REQUEUE_AFTER_EXIT=0
TRAIN_PID=""
_on_usr1() {
  note "USR1 (time limit near): asking the trainer to checkpoint, then requeueing"
  REQUEUE_AFTER_EXIT=1
  # srun forwards the signal to the tasks of its step: torchrun_node.sh on each node hands it to the ranks.
  if [[ -n $TRAIN_PID ]]; then kill -USR1 "$TRAIN_PID" 2>/dev/null || true; fi
}
trap _on_usr1 USR1

# The time-limit warning, sized (docs/cluster.md, "Preemption"): the flag is read between steps, so the
# warning must come at least one step plus one checkpoint before the end:
#   SIGNAL_LEAD_S = STEP_TIME_S + SAVE_TIME_S + SIGNAL_MARGIN_S
# STEP_TIME_S: the longest step (metrics.jsonl time/step; validation steps included); SAVE_TIME_S: one
# checkpoint (the "checkpoint" events' spacing in metrics). Defaults for the 7B paper job on 2 H200 nodes:
# a step of 256 rollouts of up to 8192 tokens (~900 s at the tail) and a 107 GB checkpoint (bf16 weights +
# fp32 master, m, v = 14 B/param x 7.6B) at ~0.5 GB/s per node of shared-filesystem write (~110 s per node
# writing half; 300 s allowed) + 120 s margin = 1320 s. #SBATCH --signal=B:USR1@120 stays as a backstop;
# this timer sends the same USR1 to the batch shell SIGNAL_LEAD_S before the job's end time.
STEP_TIME_S="${STEP_TIME_S:-900}"
SAVE_TIME_S="${SAVE_TIME_S:-300}"
SIGNAL_MARGIN_S="${SIGNAL_MARGIN_S:-120}"
SIGNAL_LEAD_S="${SIGNAL_LEAD_S:-$((STEP_TIME_S + SAVE_TIME_S + SIGNAL_MARGIN_S))}"
[[ $SIGNAL_LEAD_S =~ ^[0-9]+$ ]] || die "SIGNAL_LEAD_S=$SIGNAL_LEAD_S must be a number of seconds (the warning before the time limit)"

# Seconds from D-HH:MM:SS / HH:MM:SS / MM:SS (squeue %L); empty for UNLIMITED or NOT_SET.
_to_seconds() {
  local t="$1" d=0 h=0 m=0 s=0
  [[ $t =~ ^[0-9:-]+$ ]] || return 0
  if [[ $t == *-* ]]; then d="${t%%-*}"; t="${t#*-}"; fi
  IFS=: read -r -a p <<<"$t"
  case ${#p[@]} in
    3) h=${p[0]}; m=${p[1]}; s=${p[2]} ;;
    2) m=${p[0]}; s=${p[1]} ;;
    1) s=${p[0]} ;;
  esac
  echo $((10#$d * 86400 + 10#$h * 3600 + 10#$m * 60 + 10#$s))
}

# start_signal_timer: a background sleep that sends USR1 to this shell SIGNAL_LEAD_S before the time limit.
start_signal_timer() {
  _show batch signal-timer USR1 "${SIGNAL_LEAD_S}s" before-time-limit STEP_TIME_S="$STEP_TIME_S" SAVE_TIME_S="$SAVE_TIME_S" SIGNAL_MARGIN_S="$SIGNAL_MARGIN_S"
  [[ $DRY_RUN != 1 ]] || return 0
  [[ -n ${SLURM_JOB_ID:-} ]] || return 0
  local left
  left="$(_to_seconds "$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null | head -n1 | tr -d "[:space:]")")"
  [[ -n $left ]] || { note "no time limit known: no early USR1 timer"; return 0; }
  local wait_s=$((left - SIGNAL_LEAD_S))
  (( wait_s > 0 )) || wait_s=0
  note "USR1 in ${wait_s}s: ${SIGNAL_LEAD_S}s before the time limit (${left}s left)"
  ( sleep "$wait_s" && kill -USR1 $$ ) &
  BG_PIDS+=("$!")
}

# wait for a pid even while traps run (a trapped signal makes `wait` return early with 128+n).
_wait_pid() {
  local pid="$1" rc=0
  wait "$pid" || rc=$?
  while kill -0 "$pid" 2>/dev/null; do rc=0; wait "$pid" || rc=$?; done
  return "$rc"
}

# ---------------------------------------------------------------------------------------------------------
# Rollout engines.
#   ENGINE_BACKEND  sglang (default, GPU) | megaopd (`megaopd serve`, the embedded engine; CPU tests)
#   ENGINE_TP       GPUs per engine (model default); GPUS_PER_NODE / ENGINE_TP engines per node
#   ENGINE_PORT     first port on each node (30000); engine i listens on ENGINE_PORT + i * ENGINE_PORT_STRIDE
#   ENGINE_PORT_STRIDE (10): SGLang opens ports of its own just above its HTTP port, so engines on one
#                   node are spaced apart
#   ENGINE_MEM_FRACTION  SGLang --mem-fraction-static: 0.5 colocated (the trainer needs the rest while
#                   generating is paused), 0.85 on dedicated engine nodes
#   ENGINE_START_TIMEOUT seconds to wait for every /health (loading a 7B from a shared filesystem and
#                   capturing CUDA graphs takes minutes)
#   SGLANG_ARGS     extra launch_server flags, appended verbatim
#   ROLLOUT_DETERMINISTIC=1  SGLang honours sampling_seed (--enable-deterministic-inference, rollout.deterministic):
#                   reproducible rollouts for 25-45% of SGLang's throughput; GPU attention backends only
# plan_engines VAR: VAR names the HF directory to serve. Sets ENGINE_URLS (array) and ROLLOUT_OVERRIDES
# (rollout.engine=remote rollout.urls=[...]) and queues the servers; run_servers starts the queued servers and
# waits for them. start_engines VAR does both (evaluation); a training job checks its config in between.
# ---------------------------------------------------------------------------------------------------------
start_engines() {
  plan_engines "$@"
  run_servers
}

plan_engines() {
  if [[ ${ROLLOUT_ENGINE:-remote} == embedded ]]; then
    # Generation inside the trainer (HF transformers): no servers. For debugging and CPU jobs.
    ROLLOUT_OVERRIDES=(rollout.engine=embedded)
    return
  fi
  [[ ${ROLLOUT_ENGINE:-remote} == remote ]] || die "ROLLOUT_ENGINE=$ROLLOUT_ENGINE: choose remote (engine servers) or embedded (in the trainer)"
  # The engines serve the student's HF weights; the trainer pushes its own weights after (re)starting.
  require_path "$1" "the student's Hugging Face directory, which the rollout engines load; set $1=/path/to/hf (or MODELS_DIR)"
  stop_if_missing  # before any server line is printed
  local hf_dir="${!1:-}" engine_tp="${ENGINE_TP:-${STUDENT_ENGINE_TP:-1}}" backend="${ENGINE_BACKEND:-sglang}"
  local port0="${ENGINE_PORT:-30000}" colocated=1 per_node node i port
  # ENGINE_COLOCATED=0: the engines have their GPUs to themselves though they share nodes (evaluation).
  if (( ENGINE_NODES > 0 )) || [[ ${ENGINE_COLOCATED:-1} == 0 ]]; then colocated=0; fi
  local gpus="$GPUS_PER_NODE"
  if [[ $backend == sglang ]]; then
    (( gpus > 0 )) || die "SGLang engines need GPUs and this job has none: request --gpus-per-node, or set ENGINE_BACKEND=megaopd (CPU), or ROLLOUT_ENGINE=embedded"
    (( gpus % engine_tp == 0 )) || die "ENGINE_TP=$engine_tp does not divide the $gpus GPUs per node: choose a divisor of $gpus"
    per_node=$((gpus / engine_tp))
  else
    per_node="${ENGINES_PER_NODE:-1}"
  fi
  local frac="${ENGINE_MEM_FRACTION:-}"
  [[ -n $frac ]] || { if (( colocated )); then frac=0.5; else frac=0.85; fi; }
  local -a extra=()
  if [[ -n ${SGLANG_ARGS:-} ]]; then read -r -a extra <<<"$SGLANG_ARGS"; fi
  if [[ ${ROLLOUT_DETERMINISTIC:-0} == 1 && $backend == sglang ]]; then extra+=(--enable-deterministic-inference); fi

  ENGINE_URLS=()
  for node in "${SERVE_NODES[@]}"; do
    for ((i = 0; i < per_node; i++)); do
      port=$((port0 + i * ${ENGINE_PORT_STRIDE:-10}))
      launch_server engine "$node" "$port" "$hf_dir" "$engine_tp" $((i * engine_tp)) "$frac" "$colocated" "$backend" \
        "${extra[@]}"
    done
  done
  # The engines' workers join rank 0's weight-update group at MASTER_ADDR (the first node); colocated
  # engines release their memory while the actor trains.
  ROLLOUT_OVERRIDES=(rollout.engine=remote "rollout.urls=[$(_join , "${ENGINE_URLS[@]}")]"
                     rollout.engine_tp="$engine_tp" rollout.weight_sync_address="$MASTER_ADDR")
  if [[ ${ROLLOUT_DETERMINISTIC:-0} == 1 ]]; then ROLLOUT_OVERRIDES+=(rollout.deterministic=true); fi
  if (( ${ENGINE_NODES:-0} == 0 )); then ROLLOUT_OVERRIDES+=(rollout.colocated=true plan.engine_memory_fraction="$frac"); fi
}
ENGINE_PIDS=()      # the running servers' srun pids ...
ENGINE_PID_URLS=()  # ... and their URLs, in the same order
PENDING_SERVERS=()  # queued by launch_server, started by run_servers: each a `declare -p srun_cmd`
PENDING_URLS=()

# launch_server ROLE NODE PORT HF_DIR TP BASE_GPU FRAC COLOCATED BACKEND [SGLANG_ARG ...]: queues one server
# (SGLang, or `megaopd serve` with BACKEND=megaopd) as an srun step pinned to NODE, and prints it; appends
# http://NODE:PORT to ENGINE_URLS. run_servers starts it.
launch_server() {
  local role="$1" node="$2" port="$3" hf_dir="$4" tp="$5" base_gpu="$6" frac="$7" colocated="$8" backend="$9"
  shift 9
  local -a cmd
  # The servers listen on 0.0.0.0, so they require a key (megaopd serve refuses that bind without one): one
  # per job unless given, exported, so the trainer started from this shell sends it (rollout.api_key_env).
  if [[ -z ${MEGAOPD_API_KEY:-} ]]; then MEGAOPD_API_KEY="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"; fi
  export MEGAOPD_API_KEY
  if [[ $backend == sglang ]]; then
    cmd=("$PYTHON" -m sglang.launch_server --model-path "$hf_dir" --tp-size "$tp"
         --base-gpu-id "$base_gpu" --host 0.0.0.0 --port "$port" --mem-fraction-static "$frac"
         --api-key "$MEGAOPD_API_KEY")
    # Colocated engines give their weights and KV cache back while the trainer runs
    # (/release_memory_occupation); that needs SGLang's memory saver.
    if (( colocated )); then cmd+=(--enable-memory-saver); fi
    cmd+=("$@")
  elif [[ $backend == megaopd ]]; then
    # The key comes from the environment; weight-update groups only with the trainer's rank 0.
    cmd=("$PYTHON" -m megaopd.cli serve --hf-dir "$hf_dir" --host 0.0.0.0 --port "$port"
         --allowed-sync-host "$MASTER_ADDR")
  else
    die "ENGINE_BACKEND=$backend: choose sglang (GPU) or megaopd (the embedded engine server)"
  fi
  if [[ $REHEARSE == 1 ]]; then rehearse_server_cmd "$hf_dir" "$port"; fi  # the same server, on CPU
  ENGINE_URLS+=("http://$node:$port")
  # One srun step per server, pinned to its node; --overlap lets it share the node's GPUs and CPUs
  # with the training step. The memory saver intercepts cudaMalloc, which expandable segments bypass,
  # so the server gets the allocator's defaults.
  local -a srun_cmd=(srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap --cpus-per-task="$CPUS_PER_TASK"
                     --output="$LOG_DIR/$role-$node-$port.log" --open-mode=append
                     env -u PYTORCH_CUDA_ALLOC_CONF "${cmd[@]}")
  _show batch "${srun_cmd[@]//"$MEGAOPD_API_KEY"/'$MEGAOPD_API_KEY'}"  # the preview never shows the key
  _show "$node" "${cmd[@]//"$MEGAOPD_API_KEY"/'$MEGAOPD_API_KEY'}"
  PENDING_SERVERS+=("$(declare -p srun_cmd)")
  PENDING_URLS+=("http://$node:$port")
}

# run_servers: starts every queued server, then waits until each answers /health.
run_servers() {
  stop_if_missing
  local s i
  local -a urls=("${PENDING_URLS[@]}")
  if [[ $DRY_RUN != 1 ]]; then
    # The servers' logs go to LOG_DIR (made by make_run_dir in a training job; a job of its own may not have).
    if (( ${#PENDING_SERVERS[@]} > 0 )); then mkdir -p "$LOG_DIR"; fi
    for i in "${!PENDING_SERVERS[@]}"; do
      s="${PENDING_SERVERS[$i]}"
      local -a srun_cmd
      eval "$s"
      "${srun_cmd[@]}" &
      BG_PIDS+=("$!")
      ENGINE_PIDS+=("$!")
      ENGINE_PID_URLS+=("${PENDING_URLS[$i]}")
    done
  fi
  PENDING_SERVERS=()
  PENDING_URLS=()
  wait_engines "${urls[@]}"
}

# plan_teacher_servers: with TEACHER_NODES > 0, queues SGLang servers of the teacher (TEACHER_HF_DIR) on those nodes,
# one per TEACHER_ENGINE_TP GPUs (default: the teacher's TP), holding the whole node (no memory saver);
# sets TEACHER_OVERRIDES (teacher.engine=remote teacher.urls=[...]). The rollout temperature must be 1.0
# (SGLang scores prompts at temperature 1); the trainer refuses anything else at start-up.
plan_teacher_servers() {
  TEACHER_OVERRIDES=()
  (( TEACHER_NODES > 0 )) || return 0
  require_path TEACHER_HF_DIR "the teacher's Hugging Face directory, which its servers load; set TEACHER_HF_DIR=/path/to/hf (or MODELS_DIR)"
  stop_if_missing
  local tp="${TEACHER_ENGINE_TP:-${TEACHER_TP:-1}}" backend="${ENGINE_BACKEND:-sglang}" port0="${TEACHER_PORT:-31000}"
  local per_node=1 node i saved=("${ENGINE_URLS[@]}")
  if [[ $backend == sglang ]]; then
    (( GPUS_PER_NODE % tp == 0 )) || die "TEACHER_ENGINE_TP=$tp does not divide the $GPUS_PER_NODE GPUs per node: choose a divisor"
    per_node=$((GPUS_PER_NODE / tp))
  fi
  ENGINE_URLS=()
  for node in "${TEACHER_SERVE_NODES[@]}"; do
    for ((i = 0; i < per_node; i++)); do
      launch_server teacher "$node" $((port0 + i * 10)) "${TEACHER_HF_DIR:-}" "$tp" $((i * tp)) "${TEACHER_MEM_FRACTION:-0.85}" 0 "$backend"
    done
  done
  TEACHER_OVERRIDES=(teacher.engine=remote "teacher.urls=[$(_join , "${ENGINE_URLS[@]}")]" teacher.path="${TEACHER_HF_DIR:-}")
  ENGINE_URLS=("${saved[@]}")
}

# wait_engines URL...: until each answers /health.
wait_engines() {
  local timeout="${ENGINE_START_TIMEOUT:-1800}" url k
  for url in "$@"; do _show batch wait-for-health "$url/health"; done
  [[ $DRY_RUN != 1 ]] || return 0
  local deadline=$((SECONDS + timeout))
  for url in "$@"; do
    until curl -sf -o /dev/null --max-time 5 "$url/health"; do
      # An engine that died (bad path, OOM, missing sglang) is reported now, not after the timeout.
      for k in "${!ENGINE_PIDS[@]}"; do
        kill -0 "${ENGINE_PIDS[$k]}" 2>/dev/null || die "engine ${ENGINE_PID_URLS[$k]} exited during start-up: see $LOG_DIR/engine-*.log"
      done
      (( SECONDS < deadline )) || die "engine $url not healthy after ${timeout}s: see $LOG_DIR/engine-*.log (raise ENGINE_START_TIMEOUT for slow filesystems)"
      sleep 5
    done
    note "engine $url is up"
  done
}

# ---------------------------------------------------------------------------------------------------------
# The overrides every training job passes (TRAIN_OVERRIDES): run folder, ranks, models and their layouts,
# data, and the optional step counts. Scripts add their algorithm's settings after these.
#   TRAIN_DATA     prompts (+ golden solutions): a .parquet/.jsonl file, directory or glob
#                  (tools/prepare_openr1_math.py); DATA_SOURCES replaces it with a full YAML list,
#                  e.g. DATA_SOURCES='[{path: /d/a.parquet, weight: 3}, {path: /d/b.parquet, weight: 1}]'
#   MAX_STEPS, SAVE_INTERVAL, EVAL_INTERVAL, MAX_NEW_TOKENS   optional; the trainer's defaults otherwise
# ---------------------------------------------------------------------------------------------------------
train_base_overrides() {
  TRAIN_OVERRIDES=(run.dir="$RUN_DIR" run.world_size="$WORLD_SIZE"
                   student.path="$STUDENT_CKPT" student.tp="$STUDENT_TP" student.pp="$STUDENT_PP" student.ep="$STUDENT_EP"
                   # The reference is the student's initial weights, in the student's layout (vocab shards
                   # line up for the exact KL); on resume the trainer restores the student, not this.
                   reference.path="$STUDENT_CKPT" reference.tp="$STUDENT_TP" reference.pp="$STUDENT_PP"
                   reference.ep="$STUDENT_EP")
  if [[ -n ${TEACHER_CKPT:-} ]]; then
    TRAIN_OVERRIDES+=(teacher.path="$TEACHER_CKPT" teacher.tp="$TEACHER_TP" teacher.pp="$TEACHER_PP"
                      teacher.ep="$TEACHER_EP")
  fi
  if (( GPUS_PER_NODE > 0 )); then
    # The schema's defaults are the CPU ones (float32, no distributed optimizer): on GPUs train in bf16 and
    # shard Adam's states over the data-parallel ranks (a 7B's fp32 states alone are 84 GB).
    TRAIN_OVERRIDES+=(student.dtype=bfloat16 reference.dtype=bfloat16 optimizer.use_distributed_optimizer=true)
    if [[ -n ${TEACHER_CKPT:-} ]]; then TRAIN_OVERRIDES+=(teacher.dtype=bfloat16); fi
  fi
  if [[ -n ${DATA_SOURCES:-} ]]; then
    TRAIN_OVERRIDES+=("data.sources=$DATA_SOURCES")
  else
    require_path TRAIN_DATA "the training prompts with golden solutions (.parquet/.jsonl file, directory or glob written by tools/prepare_openr1_math.py); set TRAIN_DATA=/path/to/train.parquet, or DATA_SOURCES='[{path: A, weight: 1}, ...]' for a mixture"
    TRAIN_OVERRIDES+=("data.sources=[{path: ${TRAIN_DATA:-}, weight: 1.0}]")
  fi
  if [[ -n ${MAX_STEPS:-} ]]; then TRAIN_OVERRIDES+=(trainer.max_steps="$MAX_STEPS"); fi
  if [[ -n ${SAVE_INTERVAL:-} ]]; then TRAIN_OVERRIDES+=(trainer.save_interval="$SAVE_INTERVAL"); fi
  if [[ -n ${EVAL_INTERVAL:-} ]]; then TRAIN_OVERRIDES+=(trainer.eval_interval="$EVAL_INTERVAL"); fi
}

# ---------------------------------------------------------------------------------------------------------
# Training: one srun task per training node; each runs slurm/torchrun_node.sh, which starts torchrun with
# that node's rank. Returns the step's exit status; requeues the job when USR1 asked for it.
# ---------------------------------------------------------------------------------------------------------
run_torchrun() {
  export TRAIN_NNODES NPROC_PER_NODE
  check_trainer "$@"
  set -- "${TRAIN_ARGV[@]}"
  # --ntasks given: srun otherwise takes the job's task count (SLURM_NTASKS, one per node of the allocation), and
  # with ENGINE_NODES or TEACHER_NODES the training nodes are fewer: "More processors requested than permitted".
  local -a srun_cmd=(srun --nodes="$TRAIN_NNODES" --ntasks="$TRAIN_NNODES" --ntasks-per-node=1 --nodelist="$(_join , "${TRAIN_NODES[@]}")"
                     --overlap --cpus-per-task="$CPUS_PER_TASK" --kill-on-bad-exit=1
                     bash "$MEGAOPD_ROOT/slurm/torchrun_node.sh" "$@")
  _show batch "${srun_cmd[@]}"
  if [[ $DRY_RUN == 1 ]]; then
    local r
    for ((r = 0; r < TRAIN_NNODES; r++)); do
      # The same script srun runs, asked to print: what each node executes, with its rank filled in.
      SLURM_NODEID=$r DRY_RUN_WHERE="${TRAIN_NODES[$r]}" bash "$MEGAOPD_ROOT/slurm/torchrun_node.sh" "$@"
    done
    return 0
  fi
  local rc=0
  "${srun_cmd[@]}" &
  TRAIN_PID=$!
  BG_PIDS+=("$TRAIN_PID")
  _wait_pid "$TRAIN_PID" || rc=$?
  if (( REQUEUE_AFTER_EXIT )) && (( rc == 0 )) && [[ -n ${SLURM_JOB_ID:-} ]]; then
    note "trainer checkpointed; requeueing job $SLURM_JOB_ID (it resumes from $RUN_DIR/checkpoints/latest)"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$rc"
}

# trainer_argv ARGS...: TRAIN_ARGV, what every training rank runs after `-m megaopd.cli` (a rehearsal appends its
# CPU settings and tiny sizes).
trainer_argv() {
  TRAIN_ARGV=("$@")
  if [[ $REHEARSE == 1 ]]; then rehearse_train_args; TRAIN_ARGV+=("${REHEARSE_ARGS[@]}"); fi
}

# check_config train CONFIG [key=value ...]: `megaopd config --strict` on the trainer's exact arguments, in the
# batch shell, before any engine or rank starts (DRY_RUN=1 too): a bad setting (LR=abc, STUDENT_TP=3, a
# missing file) stops the job in seconds with the trainer's own one-line reason, and nothing is on disk yet.
# Checked once per argument list. CONFIG_CHECK=0 skips it (a submit host without the Python environment).
check_config() {
  stop_if_missing
  [[ $1 == train && -z ${TRAIN_MODULE:-} ]] || return 0  # a probe module (tests/slurm) is no trainer
  [[ ${_CONFIG_CHECKED:-} != "$*" ]] || return 0
  if [[ ${CONFIG_CHECK:-1} != 1 ]]; then
    note "CONFIG_CHECK=${CONFIG_CHECK}: the trainer's config is not checked before the job starts"
    _CONFIG_CHECKED="$*"
    return 0
  fi
  local out rc=0
  out="$(cd "$MEGAOPD_ROOT" && "$PYTHON" -m megaopd.cli config --strict "${@:2}" 2>&1 >/dev/null)" || rc=$?
  if (( rc == 2 )); then
    die "the trainer refuses this job's config (${out##*$'\n'}); fix the variable or override it names"
  elif (( rc != 0 )); then
    die "could not check the trainer's config with PYTHON=$PYTHON (exit $rc: ${out##*$'\n'}): activate megaopd's environment before submitting, or set CONFIG_CHECK=0 to skip the check"
  fi
  _CONFIG_CHECKED="$*"
  note "trainer config checked (megaopd config --strict on the job's exact arguments)"
}

# check_trainer ARGS...: trainer_argv, check_config on it, then the run folder: what a training job does
# before it starts anything (engines, the signal timer, torchrun).
check_trainer() {
  trainer_argv "$@"
  check_config "${TRAIN_ARGV[@]}"
  make_run_dir
}

# One task on the first node (conversion, evaluation): no torchrun, the tool is a single process.
run_on_first_node() {
  stop_if_missing
  local -a srun_cmd=(srun --nodes=1 --ntasks=1 --nodelist="${NODES[0]}" --cpus-per-task="$CPUS_PER_TASK" "$@")
  _show batch "${srun_cmd[@]}"
  _show "${NODES[0]}" "$@"
  [[ $DRY_RUN != 1 ]] || return 0
  "${srun_cmd[@]}"
}

note "job $JOB_NAME: $NNODES node(s) [${NODES[*]}], master $MASTER_ADDR:$MASTER_PORT, $GPUS_PER_NODE GPU(s) per node$([[ $DRY_RUN == 1 ]] && echo ', DRY RUN')"

# run_distillation [override ...]: the OPD-family job with the paper's settings (64 prompts x 4 samples,
# temperature 1.0, lr 1e-6; each overridable by its variable), rollout engines started for the student,
# extra arguments passed on as trainer overrides. CONFIG selects the algorithm's preset.
run_distillation() {
  setup_run_dir
  train_base_overrides
  plan_engines STUDENT_HF_DIR
  plan_teacher_servers
  # The preset (CONFIG, examples/paper/*.yaml) holds the paper's settings; a variable overrides one only when set.
  local -a settings=()
  if [[ -n ${PROMPTS_PER_STEP:-} ]]; then settings+=(trainer.prompts_per_step="$PROMPTS_PER_STEP"); fi
  if [[ -n ${SAMPLES_PER_PROMPT:-} ]]; then settings+=(trainer.samples_per_prompt="$SAMPLES_PER_PROMPT"); fi
  if [[ -n ${TEMPERATURE:-} ]]; then settings+=(rollout.temperature="$TEMPERATURE"); fi
  if [[ -n ${MAX_NEW_TOKENS:-} ]]; then settings+=(rollout.max_new_tokens="$MAX_NEW_TOKENS"); fi
  if [[ -n ${LR:-} ]]; then settings+=(optimizer.lr="$LR"); fi
  if [[ -n ${BENCH_DIR:-} ]]; then settings+=(validation.path="$BENCH_DIR/math500.jsonl"); fi
  local -a args=(train "$CONFIG" "${TRAIN_OVERRIDES[@]}" "${settings[@]}" "${ROLLOUT_OVERRIDES[@]}"
                 "${TEACHER_OVERRIDES[@]}" "$@")
  # The exact trainer command is checked before any server starts (run_torchrun finds it checked).
  check_trainer "${args[@]}"
  run_servers
  start_signal_timer
  run_torchrun "${args[@]}"
}
