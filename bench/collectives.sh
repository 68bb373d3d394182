#!/usr/bin/env bash
# The collectives benchmark of docs/benchmarks.md: `terse bench collectives` (reduce-scatter,
# all-gather, all-to-all against Gloo's own, and codec "auto" for reduce-scatter and all-gather:
# the plan it chose and its time against the best fixed row; docs/planner.md) on the emulated
# 4-host cluster at 1 Gbit/s and 100 Mbit/s (and "loopback": 4 local ranks, unshaped). Writes
# results/collectives-<link>.json and prints each table. --no-auto leaves auto out.
#
#   bash bench/collectives.sh [--reps 5] [--links "1gbit 100mbit"] [--size 4MiB --size 32MiB]
#
# Needs root for the emulated cluster (network namespaces); builds terse first.
set -euo pipefail
cd "$(dirname "$0")/.."
reps=5 links="1gbit 100mbit" extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) reps=$2; shift 2 ;;
    --links) links=$2; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
bash scripts/build.sh build release >/dev/null
mkdir -p results
for link in $links; do
  out="results/collectives-$link.json"
  if [ "$link" = loopback ]; then
    ./build/terse bench collectives --ranks 4 --reps "$reps" --json "$out" "${extra[@]}"
  else
    bash scripts/cluster.sh -n 4 -r "$link" -- ./build/terse bench collectives --reps "$reps" \
      --link "$link" --json "$out" "${extra[@]}" | grep '^\[host 0\]'
  fi
done
