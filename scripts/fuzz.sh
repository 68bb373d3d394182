#!/usr/bin/env bash
# Runs every fuzz_<codec> target in a build directory for a bounded time each.
#   scripts/fuzz.sh [BUILD_DIR] [SECONDS]    (defaults: build-fuzz, 10)
# Longer runs by hand: scripts/fuzz.sh build-fuzz 600. Findings are written to fuzz-findings/.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-fuzz}
seconds=${2:-10}
mkdir -p fuzz-findings
failed=()
for bin in "$dir"/fuzz/fuzz_*; do
  [ -x "$bin" ] || continue
  name=$(basename "$bin")
  if "$bin" -max_total_time="$seconds" -max_len=4096 -rss_limit_mb=2048 -print_final_stats=0 \
       -artifact_prefix="fuzz-findings/$name-" >"fuzz-findings/$name.log" 2>&1; then
    echo "fuzz: $name ok ($(grep -Eo 'stat::number_of_executed_units: *[0-9]+|#[0-9]+' \
      "fuzz-findings/$name.log" | tail -1) runs in ${seconds}s)"
  else
    echo "fuzz: $name FAILED; see fuzz-findings/$name.log"
    tail -30 "fuzz-findings/$name.log"
    failed+=("$name")
  fi
done
if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzz: ${#failed[@]} target(s) failed: ${failed[*]}"
  exit 1
fi
