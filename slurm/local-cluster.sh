#!/usr/bin/env bash
# A real Slurm on localhost, for developers and the tests (Debian/Ubuntu, as root):
#   bash slurm/local-cluster.sh install            # apt-get install slurmctld slurmd slurm-client munge
#   bash slurm/local-cluster.sh start [--nodes N]  # munged + slurmctld + one slurmd per node; waits
#                                                  # until every node is idle
#   bash slurm/local-cluster.sh status             # "up: NODES" (exit 0) or "down" (exit 1)
#   bash slurm/local-cluster.sh stop               # cancels jobs, stops exactly the daemons start started
# Then sbatch/squeue/scontrol work as on a cluster (config in /etc/slurm). No systemd, no cgroups.
# One node (the default) is this host, `hostname -s`. --nodes N > 1 makes N virtual nodes vnode1..N,
# each its own slurmd on its own port, all on this host (Debian builds Slurm with multiple-slurmd):
# `sbatch --nodes=2` then runs one batch shell and srun tasks on two "nodes", with distinct
# SLURM_NODEID and SLURMD_NODENAME, and `scontrol show hostnames` lists vnode1, vnode2.
# Knobs: SCSE_SLURM_DIR (state, logs, pids; default /tmp/scse-slurm), SCSE_SLURM_NODES (default
# node count, 1), SCSE_SLURM_CPUS (CPUs per node, default nproc; more than the machine has is fine),
# SCSE_SLURM_TIMEOUT (seconds to wait, default 60).
set -euo pipefail
DIR=${SCSE_SLURM_DIR:-/tmp/scse-slurm}
NNODES=${SCSE_SLURM_NODES:-1}
CPUS=${SCSE_SLURM_CPUS:-$(nproc)}
SLURMD_PORT=6818  # the first node's; virtual node i listens on SLURMD_PORT + i - 1
TIMEOUT=${SCSE_SLURM_TIMEOUT:-60}
CONF=/etc/slurm/slurm.conf  # where the client commands look
MARK="# written by scse-dist slurm/local-cluster.sh"
HOST=$(hostname -s 2>/dev/null || hostname)
VNODE_PREFIX=vnode

log() { echo "[local-cluster] $*" >&2; }
die() { log "ERROR: $*"; for f in "$DIR"/log/*; do [ -s "$f" ] && { echo "== $f" >&2; tail -n 20 "$f" >&2; }; done; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (slurmd must be root)"

# Pids we started, with their start time so a recycled pid is never killed.
starttime() { awk '{print $22}' "/proc/$1/stat" 2>/dev/null; }
alive() { local pid st; [ -f "$DIR/pids/$1" ] && read -r pid st < "$DIR/pids/$1" && [ "$(starttime "$pid")" = "$st" ]; }
pid_of() { local pid st; read -r pid st < "$DIR/pids/$1"; echo "$pid"; }
start_bg() {  # start_bg NAME CMD... (CMD stays in the foreground; setsid: immune to the caller's signals)
  local name=$1; shift
  setsid "$@" </dev/null >"$DIR/log/$name.out" 2>&1 &
  local pid=$! st=""
  for _ in 1 2 3 4 5 6 7 8 9 10; do st=$(starttime "$pid") && [ -n "$st" ] && break; sleep 0.05; done
  [ -n "$st" ] || die "$name exited at once"
  echo "$pid $st" > "$DIR/pids/$name"
}
wait_until() {  # wait_until WHAT CMD...
  local what=$1 end=$(( $(date +%s) + TIMEOUT )); shift
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || die "$what not ready after ${TIMEOUT}s"
    sleep 0.1
  done
}
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
node_names() {  # node_names N: the names of an N-node cluster
  if [ "$1" = 1 ]; then echo "$HOST"; else seq -f "$VNODE_PREFIX%g" 1 "$1"; fi
}
# The nodes slurmctld knows, each with its state, e.g. "vnode1 idle" (one line per node).
node_states() { sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }
all_idle() {  # all_idle NAMES...: exactly these nodes, all idle
  [ "$(node_states)" = "$(printf '%s idle\n' "$@" | sort -u)" ]
}
# The slurmds we started (pid files pids/slurmd-NODE), also those of an earlier --nodes.
started_slurmds() { local f; for f in "$DIR"/pids/slurmd*; do [ -e "$f" ] && basename "$f"; done; }
running_nodes() {  # the node names, if slurmctld and every slurmd we started are up and idle
  local d names=()
  alive slurmctld || return 1
  for d in $(started_slurmds); do alive "$d" || return 1; names+=("${d#slurmd-}"); done
  [ "${#names[@]}" -gt 0 ] && all_idle "${names[@]}" && printf '%s\n' "${names[@]}" | sort
}

install_packages() {
  local missing=0
  for b in slurmctld slurmd sbatch munged; do command -v "$b" >/dev/null || missing=1; done
  [ "$missing" = 1 ] || { log "slurm and munge are installed"; return; }
  export DEBIAN_FRONTEND=noninteractive
  # keep the packages' maintainer scripts from starting daemons
  local policy=0
  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; policy=1; }
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  [ "$policy" = 0 ] || rm -f /usr/sbin/policy-rc.d
  log "installed slurmctld slurmd slurm-client munge"
}

write_config() {  # write_config NAMES...
  local n port=$SLURMD_PORT nodes="" mem=$(( $(awk '/^MemTotal:/{print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
  mkdir -p /etc/slurm
  for f in "$CONF" /etc/slurm/cgroup.conf; do
    if [ -f "$f" ] && ! grep -qF "$MARK" "$f"; then cp -n "$f" "$f.orig"; log "kept the old $f as $f.orig"; fi
  done
  # slurmd 22.05 always loads a cgroup plugin; v1's init touches nothing (v2 needs systemd).
  printf '%s\nCgroupPlugin=cgroup/v1\nCgroupAutomount=no\n' "$MARK" > /etc/slurm/cgroup.conf
  # Every node is a slurmd on this host (NodeHostname), told apart by its port.
  for n in "$@"; do
    nodes+="NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$port CPUs=$CPUS RealMemory=$mem State=UNKNOWN"$'\n'
    port=$((port + 1))
  done
  cat > "$CONF" <<CONF
$MARK
ClusterName=scse-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/state
# %n: the node's name, so that the slurmds of virtual nodes do not share files
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
# finished jobs stay visible to scontrol/squeue for an hour (there is no accounting database)
MinJobAge=3600
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
# start jobs, and dependents released by their parent, at once
SchedulerParameters=batch_sched_delay=0
# a job whose afterok parent failed is cancelled instead of pending forever
DependencyParameters=kill_invalid_depend
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
# time between SIGTERM and SIGKILL of a cancelled job: enough to save a small checkpoint
KillWait=30
InactiveLimit=0
Waittime=0
${nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
}

start() {
  [[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, not '$NNODES'"
  local n nodes; mapfile -t nodes < <(node_names "$NNODES")
  install_packages
  mkdir -p "$DIR"/{log,pids,run,state,spool}
  if [ "$(running_nodes)" = "$(printf '%s\n' "${nodes[@]}" | sort)" ] && munge_ok && grep -qF "$MARK" "$CONF"; then
    log "already running: ${nodes[*]}"; return
  fi
  stop_daemons
  # slurmctld checks that its host resolves; the jobs resolve node names (MASTER_ADDR=vnode1).
  # Appended only when missing: /etc/hosts is often a bind mount in containers.
  for n in "$HOST" "${nodes[@]}"; do
    getent hosts "$n" >/dev/null || echo "127.0.0.1 $n" >> /etc/hosts
  done
  if ! munge_ok; then
    install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
    install -d -o munge -g munge -m 0755 /run/munge
    [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
    # munged refuses to run as root
    start_bg munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground
    wait_until munged munge_ok
  fi
  write_config "${nodes[@]}"
  rm -rf "${DIR:?}/state" "${DIR:?}/spool" "$DIR"/log/slurm*; mkdir -p "$DIR/state"
  for n in "${nodes[@]}"; do mkdir -p "$DIR/spool/$n"; done
  start_bg slurmctld /usr/sbin/slurmctld -D -i
  wait_until slurmctld sh -c 'scontrol ping | grep -q "is UP"'
  for n in "${nodes[@]}"; do start_bg "slurmd-$n" /usr/sbin/slurmd -D -N "$n"; done
  wait_until "nodes ${nodes[*]}" all_idle "${nodes[@]}"
  log "nodes ${nodes[*]} idle ($CPUS CPUs each); state and logs in $DIR"
}

stop_one() {
  alive "$1" || { rm -f "$DIR/pids/$1"; return 0; }
  local pid; pid=$(pid_of "$1")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do alive "$1" || break; sleep 0.1; done
  alive "$1" && kill -KILL "$pid"
  rm -f "$DIR/pids/$1"
}
stop_daemons() { local d; for d in $(started_slurmds); do stop_one "$d"; done; stop_one slurmctld; }

stop() {
  if alive slurmctld; then
    local jobs; jobs=$(squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 100); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
    fi
  fi
  stop_daemons
  stop_one munged
  log "stopped"
}

usage() { echo "usage: $0 install | start [--nodes N] | stop | status" >&2; exit 2; }
cmd=${1:-}; [ $# = 0 ] || shift
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) [ $# -ge 2 ] || usage; NNODES=$2; shift 2 ;;
    --nodes=*) NNODES=${1#--nodes=}; shift ;;
    *) usage ;;
  esac
done
case "$cmd" in
  install) install_packages ;;
  start) start ;;
  stop) stop ;;
  status) if nodes=$(running_nodes); then echo "up: $(echo $nodes)"; else echo down; exit 1; fi ;;
  *) usage ;;
esac
