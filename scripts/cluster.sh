#!/usr/bin/env bash
# A private test cluster of N "machines" on this one box (needs root and `ip netns`).
#
#   scripts/cluster.sh start           # create the hosts (idempotent: an existing cluster is kept)
#   scripts/cluster.sh stop            # kill every process in the hosts, delete everything start made
#   scripts/cluster.sh status          # the hosts, their addresses, links and processes
#   scripts/cluster.sh on N CMD...     # run CMD "on host N": its network namespace and host name
#   scripts/cluster.sh addr N          # host N's address
#   scripts/cluster.sh link N up|down  # plug / unplug host N's network cable
#   scripts/cluster.sh slow N RATE LATENCY   # tc tbf on host N's link, e.g. `slow 1 20mbit 50ms`
#   scripts/cluster.sh fast N          # remove what `slow` added
#   scripts/cluster.sh kill N [SIG]    # send SIG (default KILL) to every process on host N
#   scripts/cluster.sh slurm start|stop|status|env   # a SLURM over the hosts (below)
#
# Host N is a network namespace "$PREFIX-h$N" with one interface, eth0, address 192.0.2.(10+N)/24
# (a documentation range: it exists only inside these namespaces), host name "$PREFIX-host$N" (set
# by `unshare --uts` for every command run with `on`), and its own /etc/hosts
# (/etc/netns/$PREFIX-hN/hosts, which `ip netns exec` shows as /etc/hosts) naming every host, and
# a resolv.conf without a reachable name server (names resolve through /etc/hosts only). The
# hosts are plugged into a bridge that lives in a namespace of its own ("$PREFIX-sw", the switch):
# traffic from the root namespace into a namespace is refused on some machines, so every host and
# every client (a test's probe) runs in a namespace. The filesystem is shared, as on a cluster with
# NFS. Nothing outside the namespaces is changed except /etc/netns/$PREFIX-h*.
#
# `slurm start` runs scripts/slurm_cluster.sh for these hosts: munged and slurmctld on host 0, one
# slurmd per host (NodeName = the host name, NodeAddr = its address), everything in
# /var/tmp/anyaccel-cluster-$PREFIX-slurm (slurm.conf, munge key and socket, state, logs), ports
# derived from the prefix; `slurm env` prints the SLURM_CONF to use (from a host: `on N srun ...`).
# `stop` stops them too (`slurm stop`), then every other process of the hosts.
set -euo pipefail

PREFIX="${ANYACCEL_CLUSTER_PREFIX:-aa}"
HOSTS="${ANYACCEL_CLUSTER_HOSTS:-2}"
NET="192.0.2"
SW="$PREFIX-sw"

say() { echo "cluster: $*" >&2; }
die() { say "error: $1"; exit "${2:-1}"; }
need_root() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (it creates network namespaces)" 2
  ip netns list >/dev/null 2>&1 || die "\`ip netns\` is not available (iproute2 with network namespaces is needed)" 2
}
ns() { echo "$PREFIX-h$1"; }
hostname_of() { echo "$PREFIX-host$1"; }
addr() { echo "$NET.$((10 + $1))"; }
exists() { ip netns list | awk '{print $1}' | grep -qx "$1"; }
check_host() { [[ "$1" =~ ^[0-9]+$ ]] && exists "$(ns "$1")" || die "no host $1 (is the cluster started? hosts: 0..$((HOSTS - 1)))"; }

start() {
  need_root
  exists "$SW" || { ip netns add "$SW"; }
  ip -n "$SW" link show br0 >/dev/null 2>&1 || ip -n "$SW" link add br0 type bridge
  ip -n "$SW" link set br0 up
  ip -n "$SW" link set lo up
  local i hosts_file
  hosts_file="$(mktemp)"
  { echo "127.0.0.1 localhost"; for i in $(seq 0 $((HOSTS - 1))); do echo "$(addr "$i") $(hostname_of "$i")"; done; } >"$hosts_file"
  for i in $(seq 0 $((HOSTS - 1))); do
    local n; n="$(ns "$i")"
    mkdir -p "/etc/netns/$n"
    cp "$hosts_file" "/etc/netns/$n/hosts"
    # No name server can be reached from a host: ask one on the host itself, which refuses at once
    # (the machine's resolver would make every reverse lookup of a peer wait for a timeout).
    printf 'nameserver 127.0.0.1\noptions timeout:1 attempts:1\n' >"/etc/netns/$n/resolv.conf"
    if ! exists "$n"; then
      ip netns add "$n"
    fi
    if ! ip -n "$n" link show eth0 >/dev/null 2>&1; then
      ip -n "$SW" link del "$n-e" 2>/dev/null || true
      ip link add "$n-e" type veth peer name eth0 netns "$n"
      ip link set "$n-e" netns "$SW"
      ip -n "$SW" link set "$n-e" master br0 up
      ip -n "$n" addr add "$(addr "$i")/24" dev eth0
    fi
    ip -n "$n" link set lo up
    ip -n "$n" link set eth0 up
  done
  rm -f "$hosts_file"
  say "started $HOSTS hosts: $(for i in $(seq 0 $((HOSTS - 1))); do printf '%s=%s ' "$(hostname_of "$i")" "$(addr "$i")"; done)"
}

kill_ns() {  # kill_ns NAMESPACE SIGNAL: every process whose network namespace it is
  local pids
  pids="$(ip netns pids "$1" 2>/dev/null || true)"
  [ -n "$pids" ] && kill "-$2" $pids 2>/dev/null || true
}

stop() {
  need_root
  local n
  if [ -d "/var/tmp/anyaccel-cluster-$PREFIX-slurm" ]; then slurm stop || true; fi  # its daemons, by pid file
  for n in $(ip netns list | awk '{print $1}' | grep -E "^$PREFIX-(h[0-9]+|sw)$" || true); do
    kill_ns "$n" TERM
  done
  sleep 0.5
  for n in $(ip netns list | awk '{print $1}' | grep -E "^$PREFIX-(h[0-9]+|sw)$" || true); do
    kill_ns "$n" CONT
    kill_ns "$n" KILL
    for _ in $(seq 1 20); do [ -z "$(ip netns pids "$n" 2>/dev/null)" ] && break; sleep 0.25; done
    ip netns del "$n" 2>/dev/null || say "could not delete namespace $n"
    [[ "$n" == *-sw ]] || rm -rf "/etc/netns/$n"
  done
  say "stopped"
}

status() {
  local i n
  exists "$SW" || { say "not started"; return 3; }
  for i in $(seq 0 $((HOSTS - 1))); do
    n="$(ns "$i")"
    exists "$n" || { say "host $i missing"; return 3; }
    printf '%s %s %s link=%s qdisc=%s processes=%s\n' "$i" "$(hostname_of "$i")" "$(addr "$i")" \
      "$(ip -n "$n" -br link show eth0 | awk '{print $2}')" "$(tc -n "$n" qdisc show dev eth0 | awk 'NR==1{print $2}')" \
      "$(ip netns pids "$n" | wc -l)"
  done
}

on() {  # on N CMD...: CMD in host N's network namespace, with host N's name
  local i="$1"; shift
  check_host "$i"
  exec ip netns exec "$(ns "$i")" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$(hostname_of "$i")" "$@"
}

slurm() {  # slurm start|stop|status|env: scripts/slurm_cluster.sh with one node per host
  local i nodes="" sum
  for i in $(seq 0 $((HOSTS - 1))); do nodes="$nodes $(hostname_of "$i")=$(addr "$i")"; done
  sum="$(printf '%s' "$PREFIX" | cksum | cut -d' ' -f1)"
  ANYACCEL_CLUSTER_PREFIX="$PREFIX" ANYACCEL_CLUSTER_HOSTS="$HOSTS" \
    ANYACCEL_SLURM_DIR="/var/tmp/anyaccel-cluster-$PREFIX-slurm" ANYACCEL_SLURM_NODES="${nodes# }" \
    ANYACCEL_SLURM_ON="bash $(cd "$(dirname "$0")" && pwd)/cluster.sh on" \
    ANYACCEL_SLURM_CTLD_PORT="$((17000 + sum % 500 * 2))" ANYACCEL_SLURM_SLURMD_PORT="$((17001 + sum % 500 * 2))" \
    bash "$(dirname "$0")/slurm_cluster.sh" "$@"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  on) shift; [ $# -ge 2 ] || die "usage: $0 on N CMD..." 2; on "$@" ;;
  addr) check_host "$2"; addr "$2" ;;
  link) check_host "$2"; ip -n "$(ns "$2")" link set eth0 "$3" ;;
  slow) check_host "$2"; tc -n "$(ns "$2")" qdisc replace dev eth0 root tbf rate "$3" burst 32kbit latency "$4" ;;
  fast) check_host "$2"; tc -n "$(ns "$2")" qdisc del dev eth0 root 2>/dev/null || true ;;
  kill) check_host "$2"; kill_ns "$(ns "$2")" "${3:-KILL}" ;;
  slurm) shift; [ "${1:-}" = start ] && { need_root; check_host 0; }; slurm "$@" ;;
  *) echo "usage: $0 {start|stop|status|on N CMD...|addr N|link N up|down|slow N RATE LATENCY|fast N|kill N [SIG]|slurm start|stop|status|env}" >&2; exit 2 ;;
esac
