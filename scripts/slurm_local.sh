#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for tests and CI (tests/slurm/ submits jobs to it).
#
#   sudo bash scripts/slurm_local.sh          # install if missing, start, wait until the node is idle
#   sudo bash scripts/slurm_local.sh status   # sinfo + daemon pids
#   sudo bash scripts/slurm_local.sh stop     # shut the daemons down (the config stays)
#
# Idempotent: a second run finds the daemons up and only waits for the node. Needs root (munged runs as
# the munge user, slurmctld/slurmd as root) and apt (Debian's slurm-wlm 22.05 + munge). The facts it uses
# are those that worked on this project's machines: linuxproc process tracking and no task plugin,
# because the sandbox has no writable cgroup hierarchy for slurmd to manage.
set -euo pipefail

ACTION="${1:-start}"
CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
LOG_DIR=/var/log/slurm
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_PID=/run/munge/munged.pid
# How long to wait for `sinfo` to show the node idle (slurmd registers within seconds; the margin is for
# loaded CI machines).
READY_TIMEOUT_S="${SLURM_LOCAL_TIMEOUT_S:-120}"
# The first line of the config this script writes; a slurm.conf without it is someone else's and is not touched.
MARK="# Written by scripts/slurm_local.sh"

log() { echo "slurm_local: $*" >&2; }
die() { log "error: $*"; exit 1; }

alive() {  # alive PIDFILE: the process named in PIDFILE runs
  [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
      && [[ -x /usr/sbin/munged ]]; then
    return
  fi
  command -v apt-get >/dev/null || die "slurm is not installed and apt-get is missing: install slurm-wlm and munge by hand"
  log "installing slurm-wlm and munge (apt-get, about a minute)"
  local t0=$SECONDS
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null
  log "installed in $((SECONDS - t0)) s"
}

start_munge() {
  # Slurm authenticates every RPC with munge, so munged must run before slurmctld/slurmd.
  if [[ ! -s /etc/munge/munge.key ]]; then
    # The package's postinst normally creates the key; create one if it did not (e.g. a minimal image).
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
  fi
  # munged refuses keys and directories that others could read or write.
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return  # a munged already answers (ours from an earlier run, or the package's)
  fi
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
    sleep 0.2
  done
  die "munged did not start (see /var/log/munge/munged.log)"
}

write_conf() {
  # Writes slurm.conf for this host; returns 0 when the file changed (the daemons must then restart).
  local host cpus mem_mb tmp
  host="$(hostname -s)"
  cpus="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"  # GNU nproc reports OMP_NUM_THREADS when it is set
  # Leave ~15% of the memory to the OS: slurmd drains a node that reports less memory than configured.
  mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 85 / 100 ))
  tmp="$(mktemp)"
  cat >"$tmp" <<EOF
$MARK: a one-node cluster for megaopd's tests. Rewritten on each run.
ClusterName=megaopd-local
SlurmctldHost=$host
AuthType=auth/munge
# A requeued job waits for its old credential to expire before it may start again (120 s by default);
# 15 s keeps the tests' requeue path short and is still ample to launch a step on one local node.
AuthInfo=cred_expire=15
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
# No cgroup hierarchy that slurmd may manage in this sandbox: track processes by parent pid, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Cores are the consumable resource; memory is not, so jobs need no --mem.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
# A node that went down because slurmd restarted comes back by itself once slurmd registers again.
ReturnToService=2
# Seconds between SIGTERM and SIGKILL when a job is cancelled or times out.
KillWait=30
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  mkdir -p "$CONF_DIR"
  if [[ -f $CONF ]] && cmp -s "$tmp" "$CONF"; then rm -f "$tmp"; return 1; fi
  if [[ -f $CONF ]] && ! grep -q "^$MARK" "$CONF" && [[ ${SLURM_LOCAL_FORCE:-0} != 1 ]]; then
    rm -f "$tmp"
    die "$CONF was not written by this script (a cluster of its own?): left as it is. Use that cluster, or move the file aside (or set SLURM_LOCAL_FORCE=1) to let this script write its one-node config"
  fi
  mv "$tmp" "$CONF" && chmod 0644 "$CONF"
  return 0
}

stop_daemons() {
  # Only the daemons named by our pid files: ask politely, then wait for them to go.
  local f
  for f in "$SLURMD_PID" "$CTLD_PID"; do
    if alive "$f"; then kill "$(cat "$f")"; fi
  done
  for f in "$SLURMD_PID" "$CTLD_PID"; do
    for _ in $(seq 100); do alive "$f" || break; sleep 0.1; done
    alive "$f" && die "daemon $(cat "$f") from $f did not stop"
    rm -f "$f"
  done
}

start_daemons() {
  mkdir -p /var/spool/slurmctld /var/spool/slurmd "$LOG_DIR"
  alive "$CTLD_PID" || slurmctld
  alive "$SLURMD_PID" || slurmd
}

wait_idle() {
  local host state deadline=$((SECONDS + READY_TIMEOUT_S))
  host="$(hostname -s)"
  while (( SECONDS < deadline )); do
    state="$(sinfo -h -n "$host" -o %T 2>/dev/null | head -n1 || true)"
    case "$state" in
      idle|mixed|allocated|completing) log "node $host is $state"; return ;;
      drain*|down*)
        # Left drained/down by an earlier crash or restart: the node is ours, put it back in service.
        scontrol update nodename="$host" state=resume 2>/dev/null || true ;;
    esac
    sleep 1
  done
  die "node $host is not idle after ${READY_TIMEOUT_S}s (state: ${state:-none}); see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log"
}

case "$ACTION" in
  start)
    [[ $(id -u) -eq 0 ]] || die "run as root: munged, slurmctld and slurmd are started here"
    install_packages
    start_munge
    if write_conf; then
      log "wrote $CONF"
      stop_daemons  # a changed config needs fresh daemons (also the first start after a config change)
    fi
    start_daemons
    wait_idle
    ;;
  stop)
    stop_daemons
    if alive "$MUNGE_PID"; then kill "$(cat "$MUNGE_PID")"; fi
    log "stopped"
    ;;
  status)
    sinfo || true
    for f in "$CTLD_PID" "$SLURMD_PID" "$MUNGE_PID"; do
      if alive "$f"; then echo "$f: $(cat "$f") running"; else echo "$f: not running"; fi
    done
    ;;
  *) die "unknown action '$ACTION': use start (default), stop or status" ;;
esac
