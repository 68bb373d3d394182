#!/usr/bin/env bash
# The planner's accuracy grid: `terse bench planner` on unshaped loopback (`terse run`) and on
# emulated 1 Gbit/s and 100 Mbit/s links (scripts/cluster.sh, needs root), for N = 2, 3, 4.
# Each point calibrates in its own run, then predicts and measures every candidate
# configuration per size (see tools/bench_planner.cpp). One JSON per point goes to OUT; the
# summary (bench/planner_summary.py) reports the prediction error, the automatic choice against
# the best measured configuration, and codec auto against raw.
#
#   bench/planner_accuracy.sh                       # the whole grid, about 30 minutes
#   LINKS=unshaped RANKS=2 SIZES="1MiB" bench/planner_accuracy.sh
#
# Held out (conditions the planner was never tuned on: other link rates, world size, sizes):
#   OUT=results/planner-heldout LINKS="unshaped 300mbit 3gbit" RANKS=5 \
#     SIZES="256KiB 4MiB 64MiB" bench/planner_accuracy.sh
# The summary's last section checks the targets: median prediction error <= 15%, the automatic
# choice within 10% of the best measured configuration at >= 90% of points, and codec auto at
# most 5% slower than raw on unshaped links.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/planner}
reps=${REPS:-5}
sizes=${SIZES:-64KiB 1MiB 16MiB 256MiB}
ranks=${RANKS:-2 3 4}
links=${LINKS:-unshaped 1gbit 100mbit}
terse=${TERSE:-./build/terse}
mkdir -p "$out"
failed=()
for link in $links; do
  for n in $ranks; do
    json="$out/$link-n$n.json"
    echo "== $link, $n ranks -> $json" >&2
    # shellcheck disable=SC2086  # sizes is a list
    # A failed point (out of memory, say) is reported at the end; the others still run.
    if [ "$link" = unshaped ]; then
      "$terse" bench planner --ranks "$n" --sizes $sizes --reps "$reps" --json "$json" \
        | grep '^\[rank 0\]' || failed+=("$link-n$n")
    else
      bash scripts/cluster.sh -n "$n" -r "$link" -- "$terse" bench planner --sizes $sizes \
        --reps "$reps" --link "$link" --json "$json" | grep '^\[host 0\]' \
        || failed+=("$link-n$n")
    fi
  done
done
/usr/bin/python3 bench/planner_summary.py "$out"/*.json | tee "$out/summary.md"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed points: ${failed[*]}" >&2
  exit 1
fi
