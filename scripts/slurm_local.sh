#!/usr/bin/env bash
# A real Slurm cluster on this machine, for tests, CI and rehearsals (tests/slurm/ submits jobs to it).
#
#   sudo bash scripts/slurm_local.sh                # install if missing, start, wait until the nodes are idle
#   sudo bash scripts/slurm_local.sh --nodes 2      # + 2 simulated nodes sim1, sim2 (partition "sim", 4 GPUs each)
#   sudo bash scripts/slurm_local.sh --nodes 0      # back to the host node alone
#   sudo bash scripts/slurm_local.sh status         # sinfo + daemon pids
#   sudo bash scripts/slurm_local.sh stop           # shut the daemons down, remove the simulated nodes' namespaces
#
# The host node (this machine's hostname, partition "debug", the default) is always there. `--nodes N` adds N
# simulated nodes for multi-node jobs (docs/cluster.md, "Rehearsing a job"): `sbatch -p sim --nodes=2 ...`.
# Without --nodes the simulated nodes already configured are kept, so the tests that need only the host node
# do not tear down a cluster that a rehearsal set up.
#
# How a node is simulated: each simN is a network namespace (its own address 10.213.77.1N on a bridge, its own
# ports) and a UTS namespace (its own hostname) running its own slurmd; munged, slurmctld and the filesystem
# are shared, as on a cluster with a shared filesystem. Why namespaces and not slurmd's several-nodes mode
# (NodeName=... Port=..., `slurmd -N`): that mode needs Slurm built with --enable-multiple-slurmd, which
# Debian's slurm-wlm is not (`scontrol show config` has no MULTIPLE_SLURMD line); and even with it every node
# would share one hostname and one port space, so two nodes' rendezvous or engine ports (the same numbers on
# every node of a real job) would collide and `hostname` would not tell the ranks' nodes apart.
# Each simulated node declares SIM_CPUS CPUs (64) and SIM_GPUS GPUs (4: GRES "gpu" whose files are stand-in
# character devices under /run/megaopd-sim-gpus, as slurmd drops a GPU without a device file) so the
# GPU scripts' #SBATCH lines (--gpus-per-node=4 --cpus-per-task=64 --exclusive) are granted as they are;
# SlurmdParameters=config_overrides makes slurmd report those numbers instead of this machine's.
#
# Idempotent: a second run finds the daemons up and only waits for the nodes. Needs root (munged runs as
# the munge user, slurmctld/slurmd as root; namespaces) and apt (Debian's slurm-wlm 22.05 + munge) and
# iproute2. The facts it uses are those that worked on this project's machines: linuxproc process tracking
# and no task plugin, because the sandbox has no writable cgroup hierarchy for slurmd to manage.
set -euo pipefail

ACTION=start
SIM_NODES=""  # empty: keep what the config has
while (( $# )); do
  case "$1" in
    --nodes) SIM_NODES="${2:?--nodes needs a number}"; shift 2 ;;
    --nodes=*) SIM_NODES="${1#--nodes=}"; shift ;;
    start|stop|status) ACTION="$1"; shift ;;
    *) echo "slurm_local: error: unknown argument '$1': use [start|stop|status] [--nodes N]" >&2; exit 1 ;;
  esac
done
CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
GRES_CONF="$CONF_DIR/gres.conf"
LOG_DIR=/var/log/slurm
CTLD_PID=/run/slurmctld.pid
MUNGE_PID=/run/munge/munged.pid
# How long to wait for `sinfo` to show the nodes idle (slurmd registers within seconds; the margin is for
# loaded CI machines).
READY_TIMEOUT_S="${SLURM_LOCAL_TIMEOUT_S:-120}"
# The first line of the config this script writes; a slurm.conf without it is someone else's and is not touched.
MARK="# Written by scripts/slurm_local.sh"
# Simulated nodes: names, addresses, what each declares. The subnet is one no real network here uses.
SIM_PREFIX=sim
SIM_NET=10.213.77
SIM_BRIDGE=megaopd-br0
SIM_CPUS="${SIM_CPUS:-64}"
SIM_GPUS="${SIM_GPUS:-4}"
HOSTS_MARK="# megaopd simulated node (scripts/slurm_local.sh)"
# Stand-ins for the simulated GPUs' device files (char 1,3: /dev/null's numbers; nothing opens them).
SIM_GPU_DIR=/run/megaopd-sim-gpus
CTLD_LOG_OFFSET=0  # the size of slurmctld's log when this run started it: what it said since is this run's

log() { echo "slurm_local: $*" >&2; }
die() { log "error: $*"; exit 1; }

# slurmd's pid file for a node (SlurmdPidFile=/run/slurmd-%n.pid).
slurmd_pid() { echo "/run/slurmd-$1.pid"; }

# daemon_alive PIDFILE: the process PIDFILE names runs and is the daemon the file is for: its /proc comm is the
# file's name (slurmctld.pid, munged.pid; slurmd.pid: the one-node config of earlier versions), or slurmd started
# with `-N NODE` for slurmd-NODE.pid. A pid file outlives its daemon when a machine stops without shutting its
# daemons down (and a machine made from a copy of that disk has the file too): by then the pid may be any other
# process (a test worker), which must be neither taken for the daemon nor killed.
daemon_alive() {
  local pid name node=""
  [[ -s $1 ]] || return 1
  pid="$(cat "$1")"
  name="$(basename "$1" .pid)"
  if [[ $name == slurmd-* ]]; then node="${name#slurmd-}"; name=slurmd; fi
  [[ $pid =~ ^[0-9]+$ && "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name" ]] || return 1
  [[ -z $node ]] || tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qw -- "-N $node"
}

# The number of simulated nodes the config on disk has (0 when none, or no config of ours).
configured_sim_nodes() {
  local n
  n="$(sed -n 's/^# simulated nodes: \([0-9]*\)$/\1/p' "$CONF" 2>/dev/null | head -n1)"
  echo "${n:-0}"
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
  runuser -u munge -- /usr/sbin/munged 9>&-  # (9: the run lock; a daemon that kept it would hold it for good)
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
    sleep 0.2
  done
  die "munged did not start (see /var/log/munge/munged.log)"
}

write_conf() {
  # Writes slurm.conf and gres.conf for this host and SIM_NODES simulated nodes; returns 0 when a file
  # changed (the daemons must then restart).
  local host cpus mem_mb tmp gtmp ctld_host sims="" changed=1 i
  host="$(hostname -s)"
  cpus="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"  # GNU nproc reports OMP_NUM_THREADS when it is set
  # Leave ~15% of the memory to the OS: slurmd drains a node that reports less memory than configured.
  mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 85 / 100 ))
  # The simulated nodes reach slurmctld at the bridge's address (this host's name may resolve to 127.0.0.1,
  # which inside a node's namespace is that node's own loopback).
  ctld_host="$host"
  if (( SIM_NODES > 0 )); then ctld_host="$host($SIM_NET.1)"; sims="$SIM_PREFIX[1-$SIM_NODES]"; fi
  tmp="$(mktemp)"
  cat >"$tmp" <<EOF
$MARK: a local cluster for megaopd's tests. Rewritten on each run.
# simulated nodes: $SIM_NODES
ClusterName=megaopd-local
SlurmctldHost=$ctld_host
AuthType=auth/munge
# A requeued job waits for its old credential to expire before it may start again (120 s by default);
# 15 s keeps the tests' requeue path short and is still ample to launch a step on one local node.
AuthInfo=cred_expire=15
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
# One spool, pid and log file per node (%n: its name): the simulated nodes' slurmds share this filesystem.
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
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
# The simulated nodes declare more CPUs and GPUs than this machine has: slurmd reports the configured ones.
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  for ((i = 1; i <= SIM_NODES; i++)); do
    echo "NodeName=$SIM_PREFIX$i NodeAddr=$SIM_NET.$((10 + i)) CPUs=$SIM_CPUS RealMemory=$mem_mb Gres=gpu:$SIM_GPUS State=UNKNOWN" >>"$tmp"
  done
  if (( SIM_NODES > 0 )); then echo "PartitionName=sim Nodes=$sims MaxTime=INFINITE State=UP" >>"$tmp"; fi
  gtmp="$(mktemp)"
  echo "$MARK: the simulated nodes' GPUs (stand-in device files, setup_sim_network)." >"$gtmp"
  if (( SIM_NODES > 0 )); then echo "NodeName=$sims Name=gpu File=$SIM_GPU_DIR/gpu[0-$((SIM_GPUS - 1))]" >>"$gtmp"; fi
  mkdir -p "$CONF_DIR"
  if [[ -f $CONF ]] && ! grep -q "^$MARK" "$CONF" && [[ ${SLURM_LOCAL_FORCE:-0} != 1 ]]; then
    rm -f "$tmp" "$gtmp"
    die "$CONF was not written by this script (a cluster of its own?): left as it is. Use that cluster, or move the file aside (or set SLURM_LOCAL_FORCE=1) to let this script write its config"
  fi
  if ! { [[ -f $CONF ]] && cmp -s "$tmp" "$CONF"; }; then mv "$tmp" "$CONF" && chmod 0644 "$CONF"; changed=0; fi
  if ! { [[ -f $GRES_CONF ]] && cmp -s "$gtmp" "$GRES_CONF"; }; then mv "$gtmp" "$GRES_CONF" && chmod 0644 "$GRES_CONF"; changed=0; fi
  rm -f "$tmp" "$gtmp"
  return "$changed"
}

# /etc/hosts without this script's lines, plus LINES...; rewritten in place (it may be a mount point).
rewrite_hosts() {
  local tmp line
  tmp="$(mktemp)"
  grep -v "$HOSTS_MARK" /etc/hosts >"$tmp" || true
  for line in "$@"; do echo "$line $HOSTS_MARK" >>"$tmp"; done
  cat "$tmp" >/etc/hosts
  rm -f "$tmp"
}

# The simulated nodes' network: a bridge on this host ($SIM_NET.1) and one namespace per node with a veth
# into it ($SIM_NET.1N); /etc/hosts names them, so every node (and this host) resolves every other.
setup_sim_network() {
  command -v ip >/dev/null || die "simulated nodes need iproute2 (ip): apt-get install iproute2"
  if ! ip link show "$SIM_BRIDGE" >/dev/null 2>&1; then
    ip link add "$SIM_BRIDGE" type bridge
    ip addr add "$SIM_NET.1/24" dev "$SIM_BRIDGE"
  fi
  ip link set "$SIM_BRIDGE" up
  local i ns lines=()
  for ((i = 1; i <= SIM_NODES; i++)); do
    ns="megaopd-$SIM_PREFIX$i"
    if ! sim_net_ok "$i"; then
      # Missing, or left half-made: a namespace file with no namespace mounted on it (a machine made from a copy
      # of this disk has the file), a host end lost with its bridge. The node's slurmd, if one runs, is in the
      # old network: it goes too, and start_daemons starts it in the new one.
      stop_daemon "$(slurmd_pid "$SIM_PREFIX$i")"
      remove_sim_node "$i"
      ip netns add "$ns"
      ip link add "mopd-v$i" type veth peer name eth0 netns "$ns"
      ip link set "mopd-v$i" master "$SIM_BRIDGE"
      ip link set "mopd-v$i" up
      ip -n "$ns" addr add "$SIM_NET.$((10 + i))/24" dev eth0
      ip -n "$ns" link set eth0 up
      ip -n "$ns" link set lo up
      ip -n "$ns" route add default via "$SIM_NET.1"
    fi
    lines+=("$SIM_NET.$((10 + i)) $SIM_PREFIX$i")
  done
  rewrite_hosts "${lines[@]}"
  mkdir -p "$SIM_GPU_DIR"
  for ((i = 0; i < SIM_GPUS; i++)); do [[ -c $SIM_GPU_DIR/gpu$i ]] || mknod "$SIM_GPU_DIR/gpu$i" c 1 3; done
}

# sim_net_ok I: simulated node I's network is whole: its namespace is mounted (nsenter can enter it), its eth0
# has the node's address, and its host end is up on the bridge.
sim_net_ok() {
  local ns="megaopd-$SIM_PREFIX$1"
  nsenter --net="/run/netns/$ns" true 2>/dev/null || return 1
  ip -n "$ns" -o addr show dev eth0 2>/dev/null | grep -qF " $SIM_NET.$((10 + $1))/24 " || return 1
  ip -o link show "mopd-v$1" 2>/dev/null | grep -q "master $SIM_BRIDGE .*state UP"
}

# remove_sim_node I: simulated node I's namespace and veth pair, whatever is left of them.
remove_sim_node() {
  local ns="megaopd-$SIM_PREFIX$1"
  # Deleting a namespace does not always delete its veth pair's host end here.
  if ip link show "mopd-v$1" >/dev/null 2>&1; then ip link del "mopd-v$1" || true; fi
  if [[ -e /run/netns/$ns ]]; then ip netns del "$ns" 2>/dev/null || rm -f "/run/netns/$ns"; fi
}

teardown_sim_network() {
  local ns link
  for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep '^mopd-v' || true); do
    ip link del "$link" || true
  done
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^megaopd-$SIM_PREFIX" || true); do
    ip netns del "$ns" 2>/dev/null || rm -f "/run/netns/$ns"
  done
  if ip link show "$SIM_BRIDGE" >/dev/null 2>&1; then ip link del "$SIM_BRIDGE" || true; fi
  if grep -q "$HOSTS_MARK" /etc/hosts 2>/dev/null; then rewrite_hosts; fi
}

# stop_daemon PIDFILE: the daemon it names (if it runs) asked to stop, waited for; the file removed.
stop_daemon() {
  if daemon_alive "$1"; then kill "$(cat "$1")"; fi
  for _ in $(seq 100); do daemon_alive "$1" || break; sleep 0.1; done
  daemon_alive "$1" && die "daemon $(cat "$1") from $1 did not stop"
  rm -f "$1"
}

stop_daemons() {
  # Only the daemons named by our pid files (every node's slurmd, slurmctld; /run/slurmd.pid: the one-node
  # config of earlier versions): ask politely, then wait for them to go.
  local f files=(/run/slurmd.pid)
  for f in /run/slurmd-*.pid; do [[ -e $f ]] && files+=("$f"); done
  files+=("$CTLD_PID")
  for f in "${files[@]}"; do stop_daemon "$f"; done
}

# ctld_failure LOG OFFSET RC: slurmctld is not running: print what it logged since byte OFFSET of LOG (its
# fatal errors go there, not to the terminal) and the fix, then exit 1. RC: slurmctld's exit status.
# A state folder written by another cluster (a copied disk, an earlier install under another ClusterName)
# is the common case: slurmctld refuses it with "CLUSTER NAME MISMATCH" and names the file to remove.
ctld_failure() {
  local log_file=$1 offset=$2 rc=$3 said file
  said="$(tail -c +"$((offset + 1))" "$log_file" 2>/dev/null || true)"
  [[ -n $said ]] || said="$(tail -n 12 "$log_file" 2>/dev/null || true)"
  log "slurmctld is not running (it exited with status $rc); the end of $log_file:"
  printf '%s\n' "$said" | tail -n 12 | sed 's/^/  /' >&2
  if grep -q "CLUSTER NAME MISMATCH" <<<"$said"; then
    file="$(sed -n 's/^.*Remove \(.*\) to override this safety check.*$/\1/p' <<<"$said" | tail -n1)"
    file="${file:-/var/spool/slurmctld/clustername}"
    die "slurmctld refused its state folder: $file names another cluster than this config's ClusterName=megaopd-local (a copied disk or an earlier install). If that cluster is not running here, remove $file (or all of $(dirname "$file"): its jobs are forgotten) and run this script again"
  fi
  die "slurmctld did not start: fix what its log says above, then run this script again (all of it: $log_file)"
}

start_daemons() {
  local host i node offset rc=0
  host="$(hostname -s)"
  mkdir -p /var/spool/slurmctld "/var/spool/slurmd/$host" "$LOG_DIR"
  if ! daemon_alive "$CTLD_PID"; then
    offset="$(stat -c %s "$LOG_DIR/slurmctld.log" 2>/dev/null || echo 0)"
    slurmctld 9>&- || rc=$?
    # It daemonizes, then writes its pid file; a fatal error before or after ends it with a line in its log only.
    for _ in $(seq 50); do daemon_alive "$CTLD_PID" && break; sleep 0.2; done
    daemon_alive "$CTLD_PID" || ctld_failure "$LOG_DIR/slurmctld.log" "$offset" "$rc"
    CTLD_LOG_OFFSET=$offset
  fi
  daemon_alive "$(slurmd_pid "$host")" || slurmd -N "$host" 9>&-
  for ((i = 1; i <= SIM_NODES; i++)); do
    node="$SIM_PREFIX$i"
    mkdir -p "/var/spool/slurmd/$node"
    daemon_alive "$(slurmd_pid "$node")" && continue
    # The node's own network (nsenter --net) and hostname (unshare --uts): every process of its jobs sees
    # both, as on a separate machine. Not `ip netns exec`: it mounts a fresh /sys without the cgroup
    # filesystem, and slurmd refuses to start without /sys/fs/cgroup.
    nsenter --net="/run/netns/megaopd-$node" unshare --uts sh -c "hostname $node && exec slurmd -N $node" 9>&-
  done
}

wait_idle() {
  local node state deadline=$((SECONDS + READY_TIMEOUT_S)) nodes=("$(hostname -s)") i
  for ((i = 1; i <= SIM_NODES; i++)); do nodes+=("$SIM_PREFIX$i"); done
  for node in "${nodes[@]}"; do
    while :; do
      # A slurmctld that died after its start (a fatal error once its state is read) ends the wait at once.
      daemon_alive "$CTLD_PID" || ctld_failure "$LOG_DIR/slurmctld.log" "$CTLD_LOG_OFFSET" "?"
      state="$(sinfo -h -N -n "$node" -o %T 2>/dev/null | head -n1 || true)"
      case "$state" in
        idle|mixed|allocated|completing) log "node $node is $state"; break ;;
        drain*|down*)
          # Left drained/down by an earlier crash or restart: the node is ours, put it back in service.
          scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
      esac
      if (( SECONDS >= deadline )); then
        log "node $node: the end of $LOG_DIR/slurmd-$node.log:"
        tail -n 5 "$LOG_DIR/slurmd-$node.log" >&2 2>/dev/null || true
        die "node $node is not idle after ${READY_TIMEOUT_S}s (state: ${state:-none}); see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd-$node.log"
      fi
      sleep 1
    done
  done
}

# Sourced (tests/slurm/test_slurm_local_log.py: the functions above alone): nothing runs.
if (return 0 2>/dev/null); then return 0; fi  # `return` works only in a sourced file

# One run at a time: two test workers (or a user and a test) starting the cluster at once would each rewrite
# the config and restart the other's daemons. The daemons started here are not given this descriptor.
exec 9>/run/megaopd-slurm-local.lock
flock 9

case "$ACTION" in
  start)
    [[ $(id -u) -eq 0 ]] || die "run as root: munged, slurmctld and slurmd are started here"
    [[ -n $SIM_NODES ]] || SIM_NODES="$(configured_sim_nodes)"
    [[ $SIM_NODES =~ ^[0-9]+$ ]] || die "--nodes $SIM_NODES: give a number of simulated nodes (0: the host node alone)"
    install_packages
    start_munge
    if write_conf; then
      log "wrote $CONF ($SIM_NODES simulated node(s))"
      stop_daemons  # a changed config needs fresh daemons (also the first start after a config change)
      teardown_sim_network
    fi
    if (( SIM_NODES > 0 )); then setup_sim_network; fi
    start_daemons
    wait_idle
    ;;
  stop)
    stop_daemons
    teardown_sim_network
    if daemon_alive "$MUNGE_PID"; then kill "$(cat "$MUNGE_PID")"; fi
    log "stopped"
    ;;
  status)
    sinfo -N || true
    for f in "$CTLD_PID" /run/slurmd-*.pid "$MUNGE_PID"; do
      if daemon_alive "$f"; then echo "$f: $(cat "$f") running"; else echo "$f: not running"; fi
    done
    ;;
esac
