#!/usr/bin/env bash
# A real Slurm on localhost, for developers and the tests (Debian/Ubuntu, as root):
#   bash slurm/local-cluster.sh install            # apt-get install slurmctld slurmd slurm-client munge
#   bash slurm/local-cluster.sh start [--nodes N]  # munged + slurmctld + one slurmd per node; waits
#                                                  # until every node is up
#   bash slurm/local-cluster.sh status             # "up: NODE=STATE ...; J active job(s)" (exit 0)
#                                                  # or "down: WHY" (exit 1)
#   bash slurm/local-cluster.sh stop [--force]     # stops exactly the daemons start started
# Then sbatch/squeue/scontrol work as on a cluster. No systemd, no cgroups.
#
# Safe to share: a cluster with jobs is never taken down by accident. `start` on a running
# cluster keeps it (and its jobs) and says so; `start` with another configuration (--nodes,
# SCSE_SLURM_CPUS) on a cluster with queued or running jobs refuses; `stop` on a cluster with
# jobs refuses unless --force (which cancels them). The job state (StateSaveLocation) is kept
# across restarts: jobs and job ids survive a stop/start of the daemons.
#
# One node (the default) is this host, `hostname -s`. --nodes N > 1 makes N virtual nodes vnode1..N,
# each its own slurmd on its own port, all on this host (Debian builds Slurm with multiple-slurmd):
# `sbatch --nodes=2` then runs one batch shell and srun tasks on two "nodes", with distinct
# SLURM_NODEID and SLURMD_NODENAME, and `scontrol show hostnames` lists vnode1, vnode2.
#
# Knobs: SCSE_SLURM_DIR (state, logs, pids; default /tmp/scse-slurm), SCSE_SLURM_CONF (the
# slurm.conf to write; default /etc/slurm/slurm.conf, where the client commands look; any other
# path needs SLURM_CONF=that path in the client's environment), SCSE_SLURM_PORT (slurmctld's port,
# default 6817; node i's slurmd listens on PORT + i), SCSE_SLURM_NODES (default node count, 1),
# SCSE_SLURM_CPUS (CPUs per node, default nproc; more than the machine has is fine),
# SCSE_SLURM_TIMEOUT (seconds to wait, default 60). Two clusters with different DIR, CONF and PORT
# run side by side (the test suite runs its own that way and never touches this default one).
set -euo pipefail
DIR=${SCSE_SLURM_DIR:-/tmp/scse-slurm}
CONF=${SCSE_SLURM_CONF:-/etc/slurm/slurm.conf}
CTLD_PORT=${SCSE_SLURM_PORT:-6817}
NNODES=${SCSE_SLURM_NODES:-1}
# (nproc would follow OMP_NUM_THREADS, which a shared machine often sets to 1)
CPUS=${SCSE_SLURM_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
TIMEOUT=${SCSE_SLURM_TIMEOUT:-60}
MARK="# written by scse-dist slurm/local-cluster.sh"
HOST=$(hostname -s 2>/dev/null || hostname)
VNODE_PREFIX=vnode
FORCE=0
export SLURM_CONF=$CONF  # this script's own sinfo/squeue/scontrol talk to this cluster

log() { echo "[local-cluster] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
die_logs() { log "ERROR: $*"; for f in "$DIR"/log/*; do [ -s "$f" ] && { echo "== $f" >&2; tail -n 20 "$f" >&2; }; done; exit 1; }
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
  [ -n "$st" ] || die_logs "$name exited at once"
  echo "$pid $st" > "$DIR/pids/$name"
}
wait_until() {  # wait_until WHAT CMD...
  local what=$1 end=$(( $(date +%s) + TIMEOUT )); shift
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || die_logs "$what not ready after ${TIMEOUT}s"
    sleep 0.1
  done
}
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
node_names() {  # node_names N: the names of an N-node cluster
  if [ "$1" = 1 ]; then echo "$HOST"; else seq -f "$VNODE_PREFIX%g" 1 "$1"; fi
}
# The nodes slurmctld knows, each with its state, e.g. "vnode1 allocated" (one line per node).
node_states() { sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }
# A node that runs jobs or can: idle, allocated, mixed, completing (a suffix like + is a detail);
# '*' means not responding, and down/drained/failing/inval/unknown nodes take no jobs.
state_up() { case $1 in *'*'*) return 1 ;; idle*|alloc*|mix*|completing*|planned*|reserved*) return 0 ;; *) return 1 ;; esac; }
all_up() {  # all_up NAMES...: slurmctld knows exactly these nodes, and each is up
  local name state names=()
  while read -r name state; do state_up "$state" || return 1; names+=("$name"); done < <(node_states)
  [ "$(printf '%s\n' "${names[@]}" | sort)" = "$(printf '%s\n' "$@" | sort)" ]
}
active_jobs() { squeue -h -o %i 2>/dev/null | wc -l; }  # pending, running, completing, suspended
# The slurmds we started (pid files pids/slurmd-NODE), also those of an earlier --nodes.
started_slurmds() { local f; for f in "$DIR"/pids/slurmd*; do [ -e "$f" ] && basename "$f"; done; }
ctld_up() { alive slurmctld && scontrol ping 2>/dev/null | grep -q "is UP"; }

install_packages() {  # install_packages [-v]: -v says so when there is nothing to install
  local missing=0
  for b in slurmctld slurmd sbatch munged; do command -v "$b" >/dev/null || missing=1; done
  [ "$missing" = 1 ] || { [ "${1:-}" != -v ] || log "slurm and munge are installed"; return; }
  export DEBIAN_FRONTEND=noninteractive
  # keep the packages' maintainer scripts from starting daemons
  local policy=0
  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; policy=1; }
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  [ "$policy" = 0 ] || rm -f /usr/sbin/policy-rc.d
  log "installed slurmctld slurmd slurm-client munge"
}

render_config() {  # render_config NAMES...: the slurm.conf of a cluster of these nodes, on stdout
  local n port=$((CTLD_PORT + 1)) nodes="" mem=$(( $(awk '/^MemTotal:/{print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
  # Every node is a slurmd on this host (NodeHostname), told apart by its port.
  for n in "$@"; do
    nodes+="NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$port CPUs=$CPUS RealMemory=$mem State=UNKNOWN"$'\n'
    port=$((port + 1))
  done
  cat <<CONF
$MARK
ClusterName=scse-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
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

write_config() {  # write_config NAMES...
  local f etc; etc=$(dirname "$CONF")
  mkdir -p "$etc"
  for f in "$CONF" "$etc/cgroup.conf"; do
    if [ -f "$f" ] && ! grep -qF "$MARK" "$f"; then cp -n "$f" "$f.orig"; log "kept the old $f as $f.orig"; fi
  done
  # slurmd 22.05 always loads a cgroup plugin (from cgroup.conf beside slurm.conf); v1's init
  # touches nothing (v2 needs systemd).
  printf '%s\nCgroupPlugin=cgroup/v1\nCgroupAutomount=no\n' "$MARK" > "$etc/cgroup.conf"
  render_config "$@" > "$CONF"
}

start_munge() {
  munge_ok && return
  install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
  install -d -o munge -g munge -m 0755 /run/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
  # munged refuses to run as root
  start_bg munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground
  wait_until munged munge_ok
}

start_slurmds() {  # start_slurmds NAMES...: those of our slurmds that are not running
  local n
  for n in "$@"; do
    mkdir -p "$DIR/spool/$n"
    alive "slurmd-$n" || start_bg "slurmd-$n" /usr/sbin/slurmd -D -f "$CONF" -N "$n"
  done
}

start() {
  [[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, not '$NNODES'"
  local n nodes; mapfile -t nodes < <(node_names "$NNODES")
  install_packages
  mkdir -p "$DIR"/{log,pids,run,state,spool}
  if ctld_up && grep -qF "$MARK" "$CONF"; then
    local jobs; jobs=$(active_jobs)
    if [ "$(cat "$CONF")" = "$(render_config "${nodes[@]}")" ]; then
      start_munge; start_slurmds "${nodes[@]}"  # any that died; the running ones are kept
      wait_until "nodes ${nodes[*]}" all_up "${nodes[@]}"
      log "already running: $(echo $(node_states | tr ' ' =)); $jobs active job(s); kept as it is"
      return
    fi
    [ "$jobs" = 0 ] || die "running with another configuration ($CONF) and $jobs active job(s) \
(squeue); not restarting it. Wait for them, or 'stop --force' to cancel them, or start a second \
cluster with its own SCSE_SLURM_DIR, SCSE_SLURM_CONF and SCSE_SLURM_PORT"
    log "running with another configuration and no jobs: restarting as ${nodes[*]}"
  fi
  stop_daemons
  # slurmctld checks that its host resolves; the jobs resolve node names (MASTER_ADDR=vnode1).
  # Appended only when missing: /etc/hosts is often a bind mount in containers.
  for n in "$HOST" "${nodes[@]}"; do
    getent hosts "$n" >/dev/null || echo "127.0.0.1 $n" >> /etc/hosts
  done
  start_munge
  write_config "${nodes[@]}"
  rm -f "$DIR"/log/slurm*
  # The state dir is kept: jobs queued before a restart (or a crash) are recovered, never lost.
  start_bg slurmctld /usr/sbin/slurmctld -D -i -f "$CONF"
  wait_until slurmctld sh -c 'scontrol ping | grep -q "is UP"'
  start_slurmds "${nodes[@]}"
  wait_until "nodes ${nodes[*]}" all_up "${nodes[@]}"
  log "nodes ${nodes[*]} up ($CPUS CPUs each); slurmctld port $CTLD_PORT; config $CONF; state and logs in $DIR"
}

status() {
  alive slurmctld || { echo "down: slurmctld is not running (pid file $DIR/pids/slurmctld)"; return 1; }
  ctld_up || { echo "down: slurmctld does not answer 'scontrol ping' ($CONF)"; return 1; }
  local d names=() states
  for d in $(started_slurmds); do
    alive "$d" || { echo "down: ${d#slurmd-}'s slurmd is not running"; return 1; }
    names+=("${d#slurmd-}")
  done
  [ "${#names[@]}" -gt 0 ] || { echo "down: no slurmd started"; return 1; }
  states=$(echo $(node_states | tr ' ' =))
  all_up "${names[@]}" || { echo "down: nodes $states"; return 1; }
  echo "up: $states; $(active_jobs) active job(s)"
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
  if ctld_up; then
    local jobs; jobs=$(active_jobs)
    if [ "$jobs" != 0 ] && [ "$FORCE" != 1 ]; then
      die "$jobs active job(s) (squeue); not stopping. 'stop --force' cancels them first"
    fi
    if [ "$jobs" != 0 ]; then
      log "cancelling $jobs job(s)"
      scancel --full $(squeue -h -o %i) 2>/dev/null || true
      for _ in $(seq 100); do [ "$(active_jobs)" = 0 ] && break; sleep 0.1; done
    fi
  fi
  stop_daemons
  # munged is shared by every cluster on this host: it stays while another slurmctld runs.
  if pgrep -x slurmctld >/dev/null; then
    alive munged && log "munged kept: another slurmctld uses it"
  else
    stop_one munged
  fi
  log "stopped"
}

usage() { echo "usage: $0 install | start [--nodes N] | stop [--force] | status" >&2; exit 2; }
cmd=${1:-}; [ $# = 0 ] || shift
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) [ $# -ge 2 ] || usage; NNODES=$2; shift 2 ;;
    --nodes=*) NNODES=${1#--nodes=}; shift ;;
    --force) FORCE=1; shift ;;
    *) usage ;;
  esac
done
case "$cmd" in
  install) install_packages -v ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) usage ;;
esac
