#!/usr/bin/env bash
# A private SLURM cluster for the test suite (needs root; Debian/Ubuntu): one node on this
# machine, or one node per host of the namespace test cluster (scripts/cluster.sh slurm ...).
#
#   scripts/slurm_cluster.sh install   # apt-get install slurm-wlm munge (when missing)
#   scripts/slurm_cluster.sh start     # install if needed, write a private config, start munged,
#                                      # slurmctld, slurmd; wait until every node is idle
#   scripts/slurm_cluster.sh status    # sinfo of the private cluster
#   scripts/slurm_cluster.sh stop      # stop only what `start` started
#   scripts/slurm_cluster.sh env       # the line to source: export SLURM_CONF=...
#
# Everything lives in $ANYACCEL_SLURM_DIR (default /var/tmp/anyaccel-slurm): slurm.conf, munge's
# key and socket, state, spool, logs, pid files. /etc/slurm and /etc/munge are never touched, the
# ports are not SLURM's defaults (16817/16818), and every command reaches this cluster only through
# SLURM_CONF, so an existing cluster on the machine is left alone. If a slurmctld this script did
# not start is running in this network namespace, `start` refuses (exit 3) rather than guess.
#
# Several nodes: ANYACCEL_SLURM_NODES lists them ("name=address name=address ..."), and
# ANYACCEL_SLURM_ON is the command that runs a command on node i (`bash scripts/cluster.sh on`,
# followed by i and the command). munged and slurmctld run on node 0, one `slurmd -N name` on every
# node (NodeName=name NodeAddr=address, its own spool, pid file and log), every node uses node 0's
# munge socket (the filesystem is shared); the job history is cleared at each start, and `status`
# and the wait for idle nodes ask from node 0.
set -euo pipefail

DIR="${ANYACCEL_SLURM_DIR:-/var/tmp/anyaccel-slurm}"
CTLD_PORT="${ANYACCEL_SLURM_CTLD_PORT:-16817}"
SLURMD_PORT="${ANYACCEL_SLURM_SLURMD_PORT:-16818}"
CONF="$DIR/slurm.conf"
MUNGE_SOCKET="$DIR/munge/munge.socket.2"
NODES="${ANYACCEL_SLURM_NODES:-}"
ON="${ANYACCEL_SLURM_ON:-}"

say() { echo "slurm_cluster: $*" >&2; }
die() { say "error: $1"; exit "${2:-1}"; }

need_root() { [ "$(id -u)" -eq 0 ] || die "must run as root (it starts munged, slurmctld and slurmd)" 2; }

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  need_root
  command -v apt-get >/dev/null || die "slurm-wlm and munge are missing and apt-get is not available; install them yourself" 2
  say "installing slurm-wlm and munge with apt-get (a minute)"
  # waits for the package lock (.ci/run runs make test-cluster and make test-slurm side by side: both may install)
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q slurm-wlm munge >"$DIR.apt.log" 2>&1 \
    || { tail -20 "$DIR.apt.log" >&2; die "apt-get install slurm-wlm munge failed (log: $DIR.apt.log)"; }
}

ours() {  # is the daemon of pid file $1 (DIR/NAME.pid, DIR/NAME-NODE.pid) alive? (not a reused pid)
  local pid name
  name="$(basename "$1" .pid)"; name="${name%%-*}"
  [ -f "$1" ] && pid="$(cat "$1")" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] \
    && [ "$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null)" != Z ]  # a zombie is not alive
}

# The nodes, one "name=address" a line: ANYACCEL_SLURM_NODES, else this machine (no address).
nodes() { if [ -n "$NODES" ]; then printf '%s\n' $NODES; else hostname -s; fi; }
node_names() { nodes | cut -d= -f1; }
on_node() {  # on_node I CMD...: CMD on node I (here, for the one-node cluster)
  local i="$1"; shift
  if [ -n "$ON" ]; then $ON "$i" "$@"; else "$@"; fi
}
slurmd_pidfile() { if [ -n "$NODES" ]; then echo "$DIR/slurmd-$1.pid"; else echo "$DIR/slurmd.pid"; fi; }
every_slurmd_ours() { local n; for n in $(node_names); do ours "$(slurmd_pidfile "$n")" || return 1; done; }
foreign_slurmctld() {  # prints a slurmctld of this network namespace that this script did not start
  local pid
  for pid in $(pgrep -x slurmctld || true); do
    [ "$(readlink "/proc/$pid/ns/net" 2>/dev/null)" = "$(readlink /proc/self/ns/net)" ] || continue
    [ -f "$DIR/slurmctld.pid" ] && [ "$(cat "$DIR/slurmctld.pid")" = "$pid" ] && continue
    echo "$pid"; return 0
  done
  return 1
}

write_config() {
  local host cpus mem node ctld_host cred=""
  local slurmd_pid="$DIR/slurmd.pid" spool="$DIR/spool" slurmd_log="$DIR/log/slurmd.log"
  host="$(node_names | head -1)"
  ctld_host="$host"
  cpus="$(nproc)"
  mem="$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)"
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/munge" "$DIR/log"
  if [ -n "$NODES" ]; then  # one spool, pid file and log per slurmd (%n: its node name)
    slurmd_pid="$DIR/slurmd-%n.pid" spool="$DIR/spool/%n" slurmd_log="$DIR/log/slurmd-%n.log"
    ctld_host="$host($(nodes | head -1 | cut -d= -f2))"
    cred=",cred_expire=30"  # a requeued job waits this long (default 120 s) before it starts again
    for node in $(node_names); do mkdir -p "$DIR/spool/$node"; done
    # `ip netns exec` mounts a sysfs of its own, without /sys/fs/cgroup: slurmd mounts the v1
    # hierarchies it needs itself, inside the host's private mount namespace
    printf 'CgroupPlugin=cgroup/v1\nCgroupAutomount=yes\n' >"$DIR/cgroup.conf"
  fi
  chown munge:munge "$DIR/munge" && chmod 700 "$DIR/munge"
  if [ ! -f "$DIR/munge/munge.key" ]; then
    dd if=/dev/urandom bs=1 count=1024 of="$DIR/munge/munge.key" 2>/dev/null
    chown munge:munge "$DIR/munge/munge.key" && chmod 400 "$DIR/munge/munge.key"
  fi
  cat >"$CONF" <<EOF
# Written by scripts/slurm_cluster.sh: a private cluster for anyaccel's tests.
ClusterName=anyaccel-test
SlurmctldHost=$ctld_host
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET$cred
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$slurmd_pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$slurmd_log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=30
InactiveLimit=0
MinJobAge=60
EOF
  for node in $(nodes); do
    if [ -n "$NODES" ]; then
      echo "NodeName=${node%%=*} NodeAddr=${node#*=} CPUs=$cpus RealMemory=${mem:-1024} State=UNKNOWN"
    else
      echo "NodeName=$node CPUs=$cpus RealMemory=${mem:-1024} State=UNKNOWN"
    fi
  done >>"$CONF"
  echo "PartitionName=test Nodes=$(node_names | paste -sd, -) Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$CONF"
}

start() {
  need_root
  mkdir -p "$DIR"
  install
  if ours "$DIR/slurmctld.pid" && every_slurmd_ours; then
    say "already running ($CONF)"
    wait_idle
    return 0
  fi
  local foreign i node
  if [ -z "$NODES" ] && foreign="$(foreign_slurmctld)"; then
    die "a slurmctld that this script did not start is running (pid $foreign); not touching it. Stop it or set ANYACCEL_SLURM_DIR/ports for a separate test cluster." 3
  fi
  write_config
  if [ -n "$NODES" ] && ! ours "$DIR/slurmctld.pid"; then rm -rf "${DIR:?}/state"; mkdir -p "$DIR/state"; fi
  if ! ours "$DIR/munged.pid"; then
    on_node 0 munged --key-file="$DIR/munge/munge.key" --socket="$MUNGE_SOCKET" --pid-file="$DIR/munged.pid" \
      --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munge.seed" --force \
      || die "munged did not start: $(tail -5 "$DIR/log/munged.log" 2>/dev/null)"
  fi
  export SLURM_CONF="$CONF"
  ours "$DIR/slurmctld.pid" || on_node 0 slurmctld -f "$CONF" \
    || die "slurmctld did not start: $(tail -20 "$DIR/log/slurmctld.log")"
  i=0
  for node in $(node_names); do
    if [ -z "$NODES" ]; then
      ours "$DIR/slurmd.pid" || slurmd -f "$CONF" || die "slurmd did not start: $(tail -20 "$DIR/log/slurmd.log")"
    else
      ours "$(slurmd_pidfile "$node")" || on_node "$i" slurmd -f "$CONF" -N "$node" \
        || die "slurmd on $node did not start: $(tail -20 "$DIR/log/slurmd-$node.log")"
    fi
    i=$((i + 1))
  done
  wait_idle
  say "running: export SLURM_CONF=$CONF"
}

wait_idle() {
  export SLURM_CONF="$CONF"
  local i states want
  want="$(node_names | wc -l)"
  for i in $(seq 1 60); do
    states="$(on_node 0 sinfo -h -N -o %T 2>/dev/null || true)"
    [ "$(printf '%s\n' "$states" | grep -cxE 'idle|mixed|allocated' || true)" = "$want" ] && return 0
    if [ "$i" = 20 ]; then
      on_node 0 scontrol update nodename="$(node_names | paste -sd, -)" state=resume >/dev/null 2>&1 || true
    fi
    sleep 1
  done
  say "not every node became idle within 60 s (states: $(echo ${states:-unknown})); last log lines:"
  tail -15 "$DIR/log/slurmctld.log" "$DIR"/log/slurmd*.log >&2 || true
  exit 1
}

stop() {
  local file
  for file in "$DIR"/slurmd*.pid "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
    if ours "$file"; then
      kill "$(cat "$file")" 2>/dev/null || true
      for _ in $(seq 1 20); do ours "$file" || break; sleep 0.5; done
      ours "$file" && kill -9 "$(cat "$file")" 2>/dev/null || true
    fi
    rm -f "$file"
  done
  say "stopped"
}

case "${1:-}" in
  install) need_root; mkdir -p "$DIR"; install ;;
  start) start ;;
  stop) stop ;;
  status) export SLURM_CONF="$CONF"; on_node 0 sinfo ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 {install|start|status|stop|env}" >&2; exit 2 ;;
esac
