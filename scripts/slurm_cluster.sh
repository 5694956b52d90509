#!/usr/bin/env bash
# A private one-node SLURM cluster for the test suite (needs root; Debian/Ubuntu).
#
#   scripts/slurm_cluster.sh install   # apt-get install slurm-wlm munge (when missing)
#   scripts/slurm_cluster.sh start     # install if needed, write a private config, start munged,
#                                      # slurmctld, slurmd; wait until the node is idle
#   scripts/slurm_cluster.sh status    # sinfo of the private cluster
#   scripts/slurm_cluster.sh stop      # stop only what `start` started
#   scripts/slurm_cluster.sh env       # the line to source: export SLURM_CONF=...
#
# Everything lives in $ANYACCEL_SLURM_DIR (default /var/tmp/anyaccel-slurm): slurm.conf, munge's
# key and socket, state, spool, logs, pid files. /etc/slurm and /etc/munge are never touched, the
# ports are not SLURM's defaults (16817/16818), and every command reaches this cluster only through
# SLURM_CONF, so an existing cluster on the machine is left alone. If a slurmctld this script did
# not start is running, `start` refuses (exit 3) rather than guess.
set -euo pipefail

DIR="${ANYACCEL_SLURM_DIR:-/var/tmp/anyaccel-slurm}"
CTLD_PORT="${ANYACCEL_SLURM_CTLD_PORT:-16817}"
SLURMD_PORT="${ANYACCEL_SLURM_SLURMD_PORT:-16818}"
CONF="$DIR/slurm.conf"
MUNGE_SOCKET="$DIR/munge/munge.socket.2"

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
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >"$DIR.apt.log" 2>&1 \
    || { tail -20 "$DIR.apt.log" >&2; die "apt-get install slurm-wlm munge failed (log: $DIR.apt.log)"; }
}

ours() {  # is the process in pid file $1 alive?
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

write_config() {
  local host cpus mem
  host="$(hostname -s)"
  cpus="$(nproc)"
  mem="$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)"
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/munge" "$DIR/log"
  chown munge:munge "$DIR/munge" && chmod 700 "$DIR/munge"
  if [ ! -f "$DIR/munge/munge.key" ]; then
    dd if=/dev/urandom bs=1 count=1024 of="$DIR/munge/munge.key" 2>/dev/null
    chown munge:munge "$DIR/munge/munge.key" && chmod 400 "$DIR/munge/munge.key"
  fi
  cat >"$CONF" <<EOF
# Written by scripts/slurm_cluster.sh: a private one-node cluster for anyaccel's tests.
ClusterName=anyaccel-test
SlurmctldHost=$host
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
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
NodeName=$host CPUs=$cpus RealMemory=${mem:-1024} State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

start() {
  need_root
  mkdir -p "$DIR"
  install
  if ours "$DIR/slurmctld.pid" && ours "$DIR/slurmd.pid"; then
    say "already running ($CONF)"
    wait_idle
    return 0
  fi
  if pgrep -x slurmctld >/dev/null && ! ours "$DIR/slurmctld.pid"; then
    die "a slurmctld that this script did not start is running (pid $(pgrep -x slurmctld | head -1)); not touching it. Stop it or set ANYACCEL_SLURM_DIR/ports for a separate test cluster." 3
  fi
  write_config
  if ! ours "$DIR/munged.pid"; then
    munged --key-file="$DIR/munge/munge.key" --socket="$MUNGE_SOCKET" --pid-file="$DIR/munged.pid" \
      --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munge.seed" --force \
      || die "munged did not start: $(tail -5 "$DIR/log/munged.log" 2>/dev/null)"
  fi
  export SLURM_CONF="$CONF"
  ours "$DIR/slurmctld.pid" || slurmctld -f "$CONF" || die "slurmctld did not start: $(tail -20 "$DIR/log/slurmctld.log")"
  ours "$DIR/slurmd.pid" || slurmd -f "$CONF" || die "slurmd did not start: $(tail -20 "$DIR/log/slurmd.log")"
  wait_idle
  say "running: export SLURM_CONF=$CONF"
}

wait_idle() {
  export SLURM_CONF="$CONF"
  local i state
  for i in $(seq 1 60); do
    state="$(sinfo -h -o %T 2>/dev/null | head -1 || true)"
    case "$state" in idle|mixed|allocated) return 0 ;; esac
    if [ "$i" = 20 ]; then scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true; fi
    sleep 1
  done
  say "the node did not become idle within 60 s (state: ${state:-unknown}); last log lines:"
  tail -15 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
  exit 1
}

stop() {
  local name
  for name in slurmd slurmctld munged; do
    if ours "$DIR/$name.pid"; then
      kill "$(cat "$DIR/$name.pid")" 2>/dev/null || true
      for _ in $(seq 1 20); do ours "$DIR/$name.pid" || break; sleep 0.5; done
      ours "$DIR/$name.pid" && kill -9 "$(cat "$DIR/$name.pid")" 2>/dev/null || true
    fi
    rm -f "$DIR/$name.pid"
  done
  say "stopped"
}

case "${1:-}" in
  install) need_root; mkdir -p "$DIR"; install ;;
  start) start ;;
  stop) stop ;;
  status) export SLURM_CONF="$CONF"; sinfo ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 {install|start|status|stop|env}" >&2; exit 2 ;;
esac
