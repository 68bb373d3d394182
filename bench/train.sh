#!/usr/bin/env bash
# The training benchmark of docs/training.md (bench/train.py): DDP fp32, PyTorch's fp16 and
# PowerSGD hooks and the terse hook with several codecs and codec=auto train the MLP and CNN on
# Fashion-MNIST and a VGG-style CNN on synthetic data, 4 ranks on the emulated cluster, one link
# rate after the other; then the report updates docs/training.md and its plots.
#
#   bash bench/train.sh [--links "100mbit 1gbit unshaped"] [bench/train.py run options]
#
# Resumable: every configuration writes results/train/<link>/<model>/<method>.json and is skipped
# when that file exists, so the same command continues an interrupted benchmark (delete a file,
# or pass --force, to measure it again). One link rate per invocation keeps each part short:
#   bash bench/train.sh --links 1gbit
# Needs root (network namespaces and tc); builds terse first.
set -euo pipefail
cd "$(dirname "$0")/.."
links="100mbit 1gbit unshaped" extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --links) links=$2; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
bash scripts/build.sh build release >/dev/null
export PYTHONPATH="$PWD/build/python"
for link in $links; do
  # Debian's torch imports only into /usr/bin/python3.
  /usr/bin/python3 bench/train.py run --link "$link" "${extra[@]}"
done
/usr/bin/python3 bench/train.py report --update docs/training.md --plots docs \
  --markdown results/train/report.md > /dev/null
echo "bench/train.sh: docs/training.md, docs/training-*.png and results/train/report.md updated"
