#!/usr/bin/env bash
# The allreduce benchmark of docs/benchmarks.md: `terse bench allreduce` on 4 ranks, unshaped
# (local processes over loopback) and on the emulated 4-host cluster at 1 Gbit/s and 100 Mbit/s.
# Writes results/allreduce-<link>.json and prints each table; bench/report.py turns the JSON
# files into markdown.
#
#   bash bench/allreduce.sh [--size 100MB] [--reps 5] [--links "loopback 1gbit 100mbit"]
#
# Needs root for the emulated cluster (network namespaces); builds terse first.
set -euo pipefail
cd "$(dirname "$0")/.."
size=100MB reps=5 links="loopback 1gbit 100mbit" extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --size) size=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --links) links=$2; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
bash scripts/build.sh build release >/dev/null
mkdir -p results
for link in $links; do
  out="results/allreduce-$link.json"
  if [ "$link" = loopback ]; then
    ./build/terse bench allreduce --ranks 4 --size "$size" --reps "$reps" --json "$out" \
      "${extra[@]}"
  else
    bash scripts/cluster.sh -n 4 -r "$link" -- ./build/terse bench allreduce --size "$size" \
      --reps "$reps" --link "$link" --json "$out" "${extra[@]}" | grep '^\[host 0\]'
  fi
done
