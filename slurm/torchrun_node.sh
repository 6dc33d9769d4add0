#!/usr/bin/env bash
# Runs on every training node as that node's one srun task (slurm/common.sh, run_torchrun): torchrun with
# this node's rank, which starts NPROC_PER_NODE ranks of `megaopd.cli ARGS...` (e.g. `train CONFIG k=v`).
# TRAIN_MODULE replaces megaopd.cli (tests/slurm runs a probe through this same path).
#
# Environment (exported by common.sh, carried by srun): TRAIN_NNODES, NPROC_PER_NODE, MASTER_ADDR,
# MASTER_PORT, MEGAOPD_ROOT; SLURM_NODEID (set by srun) is the node rank. With DRY_RUN=1 it prints the
# command as "[DRY_RUN_WHERE] torchrun ..." instead of running it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/print.sh"

# The node rank: srun numbers the step's nodes 0..N-1 in allocation order, the first node (the master
# address) being 0. Training uses the first nodes of the allocation, so this is also the job's node index.
node_rank="${SLURM_NODEID:?SLURM_NODEID is unset: this script runs as an srun task (see slurm/common.sh run_torchrun)}"

# Static rendezvous at the first node: every node knows its rank, so no etcd/c10d rendezvous store and
# no race over who becomes rank 0 (the first node also writes the run folder's files).
cmd=("${TORCHRUN:-torchrun}" --nnodes="$TRAIN_NNODES" --nproc-per-node="$NPROC_PER_NODE" --node-rank="$node_rank"
     --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" -m "${TRAIN_MODULE:-megaopd.cli}" "$@")

_show "${DRY_RUN_WHERE:-$(hostname -s)}" "${cmd[@]}"  # DRY_RUN=1, or a rehearsal's log (SHOW_COMMANDS=1)
[[ ${DRY_RUN:-0} != 1 ]] || exit 0

cd "$MEGAOPD_ROOT"
# CPU threads per rank: the task's CPUs shared by its ranks (torchrun would otherwise force 1).
cpus="${SLURM_CPUS_PER_TASK:-$(nproc)}"
threads=$((cpus / NPROC_PER_NODE))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}"

# torchrun dies on USR1 (it handles only TERM/INT/HUP/QUIT), so it runs with USR1 ignored; the ranks
# install their own handler (checkpoint, then exit 0). srun delivers a forwarded signal to every process
# of the step, ranks included; this shell also hands USR1 to torchrun's children (the ranks), for launchers
# that signal only the task's first process. A rank that gets it twice just sets its flag twice.
( trap '' USR1; exec "${cmd[@]}" ) &
torchrun_pid=$!
trap 'pkill -USR1 -P "$torchrun_pid" || true' USR1

# A trapped signal makes `wait` return early: wait until torchrun is really gone, then return its status.
rc=0
wait "$torchrun_pid" || rc=$?
while kill -0 "$torchrun_pid" 2>/dev/null; do rc=0; wait "$torchrun_pid" || rc=$?; done
exit "$rc"
