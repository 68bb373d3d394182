#!/usr/bin/env bash
# Emulates an N-host cluster on this machine and runs a command on every host.
#
#   scripts/cluster.sh -n N -r RATE|unshaped [-p PORT] [-b BURST] [-c auto|none] -- COMMAND ...
#   scripts/cluster.sh -k RATE     prints the token bucket (bytes) a link of RATE gets, and exits
#
# Topology: a "switch" network namespace holding a bridge, and N "host" namespaces, each joined
# to the bridge by a veth pair (eth0 in the host, sI in the switch). Every link is shaped with
# tbf to RATE (tc syntax: 10gbit, 1gbit, 100mbit) in both directions: on eth0 (upload) and on
# sI (download); RATE "unshaped" adds no qdisc (veth at full speed). Addresses come from
# 10.77.0.0/24 and exist only inside these namespaces; the root namespace is not touched.
# Namespace names carry a per-invocation prefix, so parallel runs do not clash. Everything is
# torn down on exit, also on failure or interruption.
#
# COMMAND runs in host I with RANK=I, WORLD_SIZE=N, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1,
# MASTER_ADDR=10.77.0.1 (host 0), MASTER_PORT=PORT (default 29500) and TERSE_IFNAME=eth0, its
# output prefixed by "[host I] ". The script fails if any host's command fails; the others are
# then stopped. Needs root, iproute2 and tc.
# -c auto (default: TERSE_BIND, else auto) binds host I's command to its own cores as `terse run
# --bind auto` does (src/kit/host.h, kit::binding): where N divides this machine's cores, each
# emulated host gets a block of them; -c none does not bind.
set -euo pipefail

usage() {
  echo "usage: $0 -n N -r RATE [-p PORT] [-b BURST] [-c auto|none] -- COMMAND [ARGS...]" >&2
  echo "       $0 -k RATE" >&2
  exit 2
}

rate_bps() {
  local r=${1,,} num unit
  num=${r%%[a-z]*}
  [[ "$num" =~ ^[0-9]+$ ]] || { echo "$0: rate $1 must be an integer with a unit" >&2; exit 2; }
  unit=${r#"$num"}
  case "$unit" in
    gbit) echo $((num * 1000000000)) ;;
    mbit) echo $((num * 1000000)) ;;
    kbit) echo $((num * 1000)) ;;
    bit | "") echo "$num" ;;
    *) echo "$0: unknown rate unit in $1 (use gbit, mbit, kbit)" >&2; exit 2 ;;
  esac
}
# A -b BURST in bytes: NUM, NUMb, NUMk or NUMkb (KiB), NUMm or NUMmb (MiB), as tc reads them.
burst_bytes() {
  local b=${1,,} num unit
  num=${b%%[a-z]*}
  unit=${b#"$num"}
  [[ "$num" =~ ^[0-9]+$ ]] || { echo "$0: burst $1 must be NUM[b|kb|mb] bytes" >&2; exit 2; }
  case "$unit" in
    "" | b) echo "$num" ;;
    k | kb) echo $((num * 1024)) ;;
    m | mb) echo $((num * 1048576)) ;;
    *) echo "$0: burst $1 must be NUM[b|kb|mb] bytes" >&2; exit 2 ;;
  esac
}
# tbf's bucket (burst) for a link of BPS bits/s: the traffic a link lets through at full speed
# after idling, which no real link does, so it is kept to what holds the rate: 2.1 ms of traffic,
# and at least 16 KiB (eleven full frames). tbf cuts a GSO packet larger than the bucket into
# frames, so the bucket need not hold one. python/terse/pipeline_model.py models the bucket by
# asking this function (-k).
bucket_for() {
  local bytes=$(($1 / 80000 * 21))
  [ "$bytes" -lt 16384 ] && bytes=16384
  echo "$bytes"
}

n="" rate="" port=29500 burst="" bind=${TERSE_BIND:-auto}
while getopts "n:r:p:b:c:k:h" opt; do
  case "$opt" in
    k) bps=$(rate_bps "$OPTARG"); bucket_for "$bps"; exit 0 ;;
    n) n=$OPTARG ;;
    r) rate=$OPTARG ;;
    p) port=$OPTARG ;;
    b) burst=$OPTARG ;;
    c) bind=$OPTARG ;;
    *) usage ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift
[ -n "$n" ] && [ -n "$rate" ] && [ $# -gt 0 ] || usage
[[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || { echo "$0: bad -n $n" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "$0: needs root (ip netns)" >&2; exit 2; }
[ "$bind" = auto ] || [ "$bind" = none ] || { echo "$0: -c must be auto or none" >&2; exit 2; }

# Host I's CPUs under -c auto (kit::binding's rule): with N dividing the CPUs this script may
# use, a block of CPUs/N of them; else (more hosts than CPUs, say) all of them.
cpus=()
for range in $(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/self/status | tr , ' '); do
  for ((c = ${range%-*}; c <= ${range#*-}; c++)); do cpus+=("$c"); done
done
host_cpus() {
  local i=$1 count=${#cpus[@]}
  if [ "$bind" = none ] || [ "$n" -le 1 ] || [ "$count" -le 1 ]; then
    return
  elif ((count % n == 0)); then
    local block=$((count / n)) list=()
    for ((c = i * block; c < (i + 1) * block; c++)); do list+=("${cpus[$c]}"); done
    (IFS=,; echo "${list[*]}")
  fi
}

# The queue (limit): 10 ms of traffic plus the bucket, counted as at least 256 KiB.
limit=""
if [ "$rate" != unshaped ]; then
  bps=$(rate_bps "$rate")
  [ -z "$burst" ] && burst="$(bucket_for "$bps")b"
  bucket=$(burst_bytes "$burst")
  [ "$bucket" -lt 262144 ] && bucket=262144
  limit="$((bps / 800 + bucket))b"
fi

prefix="tc$$x${RANDOM}"
switch="${prefix}sw"
hosts=()
pids=()

teardown() {
  local status=$?
  trap - EXIT INT TERM
  for ns in "${hosts[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
  done
  for ns in "${hosts[@]}" "$switch"; do
    ip netns del "$ns" 2>/dev/null || true
  done
  [ -n "${statusdir:-}" ] && rm -rf "$statusdir"
  exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ip netns add "$switch"
ip -n "$switch" link set lo up
ip -n "$switch" link add br0 type bridge
ip -n "$switch" link set br0 up
for ((i = 0; i < n; i++)); do
  ns="${prefix}h$i"
  ip netns add "$ns"
  hosts+=("$ns")
  ip -n "$ns" link set lo up
  ip link add eth0 netns "$ns" type veth peer name "s$i" netns "$switch"
  ip -n "$switch" link set "s$i" master br0
  ip -n "$switch" link set "s$i" up
  ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  if [ "$rate" != unshaped ]; then
    ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst "$burst" limit "$limit"
    ip netns exec "$switch" tc qdisc add dev "s$i" root tbf rate "$rate" burst "$burst" \
      limit "$limit"
  fi
done

# Each host's exit status lands in a file, and a line on a FIFO wakes the loop below, so that
# the first failure can stop the others without relying on job-control corner cases of
# `wait -n`. The loop waits with bash's own `read -t` (a second at most, in case a wake-up is
# lost): no process is started while the hosts run, where polling with sleep(1) ten times a
# second took about 5% of a 2-core machine away from the training being measured.
statusdir=$(mktemp -d)
mkfifo "$statusdir/wake"
exec {wake}<>"$statusdir/wake"
for ((i = 0; i < n; i++)); do
  (
    set +e
    pin=$(host_cpus "$i")
    ip netns exec "${hosts[$i]}" env RANK="$i" WORLD_SIZE="$n" LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
      MASTER_ADDR=10.77.0.1 MASTER_PORT="$port" TERSE_IFNAME=eth0 \
      ${pin:+taskset -c "$pin"} "$@" \
      > >(sed -u "s/^/[host $i] /") 2> >(sed -u "s/^/[host $i] /" >&2)
    echo $? > "$statusdir/$i"
    echo "$i" > "$statusdir/wake"
  ) &
  pids+=($!)
done

failed=0
while true; do
  finished=0
  for ((i = 0; i < n; i++)); do
    [ -s "$statusdir/$i" ] || continue
    finished=$((finished + 1))
    read -r status < "$statusdir/$i"
    if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
      failed=$status
      echo "cluster.sh: host $i failed (status $status); stopping the others" >&2
      for ns in "${hosts[@]}"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null || true; done
      done
    fi
  done
  [ "$finished" -eq "$n" ] && break
  read -r -t 1 -u "$wake" _ || true
done
wait
exec {wake}<&-
rm -rf "$statusdir"
sleep 0.1  # let the output filters flush
exit "$failed"
