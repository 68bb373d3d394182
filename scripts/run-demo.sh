#!/usr/bin/env bash
# The main job. Installs what terse needs, builds it, and runs the codec benchmark on a real
# 25M-float gradient (later: the distributed training demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh build release
mkdir -p results
./build/terse bench codecs --json results/bench-codecs.json
