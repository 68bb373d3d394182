#!/usr/bin/env bash
# Emulates an N-host cluster on this machine and runs a command as every rank of every host.
#
#   scripts/cluster.sh -n N -r RATE|unshaped [-l L|L0,L1,...] [-p PORT] [-b BURST] [-c auto|none]
#                      [-e K] -- COMMAND ...
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
# -l gives the ranks per host (1..64 each; default 1): L for every host, or a comma list with
# one count per host (N of them), so hosts may be uneven (-n 2 -l 3,2). Ranks are numbered host
# by host: host I's local rank J is rank R = (the ranks of hosts 0..I-1) + J. COMMAND runs once
# per rank, in its host's namespace, with RANK=R, WORLD_SIZE=(all ranks), LOCAL_RANK=J,
# LOCAL_WORLD_SIZE=(host I's ranks), GROUP_RANK=I (torchrun's name for the node index),
# MASTER_ADDR=10.77.0.1 (host 0), MASTER_PORT=PORT (default 29500), TERSE_IFNAME=eth0 and
# TERSE_JOB_SECRET (the caller's, else a fresh one for the job, as `terse run` gives). The
# ranks of one host share its namespace: between them traffic stays on that namespace's stack,
# unshaped; only the host's link (its veth) is. Output is prefixed by "[host I] " where every
# host has one rank, else by "[host I rank R] ". The script fails if any rank's command fails
# (with that status); the others are then stopped. Needs root, iproute2 and tc.
# -c auto (default: TERSE_BIND, else auto) binds each rank's command to its own cores as `terse
# run --bind auto` does (src/kit/host.h, kit::binding): where the total number of ranks divides
# this machine's cores, each rank gets a block of them, in rank order (with one rank per host:
# a block per emulated host); otherwise no rank is bound. -c none does not bind.
# -e K runs the job elastic (terse.elastic's live recovery, docs/elastic.md): `terse run
# --elastic --max-restarts K` (build/terse, or $TERSE) runs in host 0's namespace, serves the
# store at 10.77.0.1:PORT, and starts each rank in its host's namespace with the variables above;
# a rank that dies is started again there, up to K times, while the others go on. Output is then
# prefixed by the launcher's "[rank R] ", and TERSE_TIMEOUT, if set, becomes its --timeout.
set -euo pipefail

usage() {
  echo "usage: $0 -n N -r RATE [-l L|L0,L1,...] [-p PORT] [-b BURST] [-c auto|none]" \
    "[-e K] -- COMMAND [ARGS...]" >&2
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

n="" rate="" port=29500 burst="" bind=${TERSE_BIND:-auto} per_host=1 elastic=""
while getopts "n:r:p:b:c:l:k:e:h" opt; do
  case "$opt" in
    k) bps=$(rate_bps "$OPTARG"); bucket_for "$bps"; exit 0 ;;
    n) n=$OPTARG ;;
    r) rate=$OPTARG ;;
    p) port=$OPTARG ;;
    b) burst=$OPTARG ;;
    c) bind=$OPTARG ;;
    l) per_host=$OPTARG ;;
    e) elastic=$OPTARG ;;
    *) usage ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift
[ -n "$n" ] && [ -n "$rate" ] && [ $# -gt 0 ] || usage
[[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || { echo "$0: bad -n $n" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "$0: needs root (ip netns)" >&2; exit 2; }
[ "$bind" = auto ] || [ "$bind" = none ] || { echo "$0: -c must be auto or none" >&2; exit 2; }
[ -z "$elastic" ] || [[ "$elastic" =~ ^[0-9]+$ ]] || {
  echo "$0: -e takes how often a rank may be restarted (a count)" >&2; exit 2; }

# -l: counts[I] ranks on host I. A count is 1..64 (leading zeros allowed, read as decimal).
bad_l() {
  echo "$0: bad -l $per_host: $1; give L (every host runs L ranks) or L0,L1,... (one count" \
    "per host, $n of them), each 1..64" >&2
  usage
}
counts=()
if [[ "$per_host" =~ ^[0-9]+$ ]]; then
  for ((i = 0; i < n; i++)); do counts+=("$per_host"); done
elif [[ "$per_host" =~ ^[0-9]+(,[0-9]+)+$ ]]; then
  IFS=, read -r -a counts <<< "$per_host"
  [ "${#counts[@]}" -eq "$n" ] || bad_l "it lists ${#counts[@]} hosts, -n is $n"
else
  bad_l "not a count or a comma list of counts"
fi
for ((i = 0; i < n; i++)); do
  if ! [[ "${counts[$i]}" =~ ^0*[0-9]{1,2}$ ]] || ((10#${counts[$i]} < 1 || 10#${counts[$i]} > 64))
  then
    if [[ "$per_host" == *,* ]]; then bad_l "host $i's count ${counts[$i]} is not in 1..64"
    else bad_l "$per_host ranks per host is not in 1..64"; fi
  fi
  counts[i]=$((10#${counts[$i]}))
done
# Rank R runs on host rank_host[R] as its local rank rank_local[R]; world: all ranks. A rank is
# labelled "host I" where every host has one rank (as before -l existed), else "host I rank R".
rank_host=() rank_local=() labels=() world=0
for ((i = 0; i < n; i++)); do
  for ((l = 0; l < counts[i]; l++)); do
    rank_host+=("$i")
    rank_local+=("$l")
  done
  world=$((world + counts[i]))
done
for ((r = 0; r < world; r++)); do
  if [ "$world" -eq "$n" ]; then labels+=("host ${rank_host[$r]}")
  else labels+=("host ${rank_host[$r]} rank $r"); fi
done

# Rank R's CPUs under -c auto (kit::binding's rule, over all ranks of all hosts): with the
# total number of ranks dividing the CPUs this script may use, the R-th block of CPUs/ranks of
# them; else (more ranks than CPUs, say) none, and the rank may run on all of them.
cpus=()
for range in $(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/self/status | tr , ' '); do
  for ((c = ${range%-*}; c <= ${range#*-}; c++)); do cpus+=("$c"); done
done
rank_cpus() {
  local r=$1 count=${#cpus[@]}
  if [ "$bind" = none ] || [ "$world" -le 1 ] || [ "$count" -le 1 ]; then
    return
  elif ((count % world == 0)); then
    local block=$((count / world)) list=()
    for ((c = r * block; c < (r + 1) * block; c++)); do list+=("${cpus[$c]}"); done
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

# Each rank's exit status lands in a file of its own, and a line on a FIFO wakes the loop below,
# so that the first failure can stop the others without relying on job-control corner cases of
# `wait -n`. The loop waits with bash's own `read -t` (a second at most, in case a wake-up is
# lost): no process is started while the ranks run, where polling with sleep(1) ten times a
# second took about 5% of a 2-core machine away from the training being measured.
statusdir=$(mktemp -d)
mkfifo "$statusdir/wake"
# One secret for every rank of the job, so that only they get into its store and connections
# (docs/security.md).
if [ -z "${TERSE_JOB_SECRET:-}" ]; then
  TERSE_JOB_SECRET=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
fi
export TERSE_JOB_SECRET
if [ -n "$elastic" ]; then
  # The launcher, in host 0's namespace, starts this step for each rank: it enters the rank's
  # host's namespace and runs COMMAND there with the rank's host variables.
  terse_bin=${TERSE:-$(cd "$(dirname "$0")/.." && pwd)/build/terse}
  step="$statusdir/rank-step"
  {
    echo '#!/usr/bin/env bash'
    printf 'ns=(%s)\n' "$(printf '%q ' "${hosts[@]}")"
    printf 'host=(%s)\n' "${rank_host[*]}"
    printf 'local=(%s)\n' "${rank_local[*]}"
    printf 'count=(%s)\n' "${counts[*]}"
    echo 'i=${host[$RANK]}'
    echo 'exec ip netns exec "${ns[$i]}" env LOCAL_RANK="${local[$RANK]}" \'
    echo '  LOCAL_WORLD_SIZE="${count[$i]}" GROUP_RANK="$i" TERSE_IFNAME=eth0 "$@"'
  } > "$step"
  chmod +x "$step"
  set +e
  ip netns exec "${hosts[0]}" "$terse_bin" run --elastic --max-restarts "$elastic" \
    -n "$world" --master-addr 10.77.0.1 --master-port "$port" --bind "$bind" \
    ${TERSE_TIMEOUT:+--timeout "$TERSE_TIMEOUT"} -- "$step" "$@"
  status=$?
  set -e
  exit "$status"
fi
exec {wake}<>"$statusdir/wake"
for ((r = 0; r < world; r++)); do
  i=${rank_host[$r]}
  tag="[${labels[$r]}] "
  (
    set +e
    pin=$(rank_cpus "$r")
    ip netns exec "${hosts[$i]}" env RANK="$r" WORLD_SIZE="$world" LOCAL_RANK="${rank_local[$r]}" \
      LOCAL_WORLD_SIZE="${counts[$i]}" GROUP_RANK="$i" \
      MASTER_ADDR=10.77.0.1 MASTER_PORT="$port" TERSE_IFNAME=eth0 \
      ${pin:+taskset -c "$pin"} "$@" \
      > >(sed -u "s/^/$tag/") 2> >(sed -u "s/^/$tag/" >&2)
    echo $? > "$statusdir/$r"
    echo "$r" > "$statusdir/wake"
  ) &
  pids+=($!)
done

failed=0
while true; do
  finished=0
  for ((r = 0; r < world; r++)); do
    [ -s "$statusdir/$r" ] || continue
    finished=$((finished + 1))
    read -r status < "$statusdir/$r"
    if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
      failed=$status
      echo "cluster.sh: ${labels[$r]} failed (status $status); stopping the others" >&2
      for ns in "${hosts[@]}"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null || true; done
      done
    fi
  done
  [ "$finished" -eq "$world" ] && break
  read -r -t 1 -u "$wake" _ || true
done
wait
exec {wake}<&-
rm -rf "$statusdir"
sleep 0.1  # let the output filters flush
exit "$failed"
