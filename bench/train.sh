#!/usr/bin/env bash
# The training benchmark of docs/training.md (bench/train.py): DDP fp32, PyTorch's fp16, bf16 and
# PowerSGD hooks and the terse hook with several codecs and codec=auto train the MLP and CNN on
# Fashion-MNIST and a VGG-style CNN on synthetic data, 4 ranks on the emulated cluster, one link
# rate after the other; then the report updates docs/training.md and its plots.
#
#   bash bench/train.sh [--torch 2|1.13] [--links "100mbit 1gbit unshaped"] [bench/train.py run options]
#
# --torch 2 (default): PyTorch 2.x from the project's virtual environment ($TERSE_VENV, default
# /opt/terse/venv), results in results/train-torch2, the page's "torch2" report. --torch 1.13:
# Debian's torch in /usr/bin/python3, results in results/train, the page's other report.
# Resumable: every configuration writes results/.../<link>/<model>/<method>.json and is skipped
# when that file exists, so the same command continues an interrupted benchmark (delete a file,
# or pass --force, to measure it again). One link rate per invocation keeps each part short:
#   bash bench/train.sh --links 1gbit
# Needs root (network namespaces and tc); builds terse first.
set -euo pipefail
cd "$(dirname "$0")/.."
links="100mbit 1gbit unshaped" extra=() torch=2
while [ $# -gt 0 ]; do
  case "$1" in
    --links) links=$2; shift 2 ;;
    --torch) torch=$2; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
case "$torch" in
  2) python=${TERSE_VENV:-/opt/terse/venv}/bin/python results=results/train-torch2 section=torch2 ;;
  1.13) python=/usr/bin/python3 results=results/train section="" ;;
  *) echo "bench/train.sh: --torch must be 2 or 1.13" >&2; exit 2 ;;
esac
bash scripts/build.sh build release >/dev/null
export PYTHONPATH="$PWD/build/python"
for link in $links; do
  "$python" bench/train.py run --link "$link" --results "$results" "${extra[@]}"
done
"$python" bench/train.py report --results "$results" --section "$section" \
  --update docs/training.md --plots docs --markdown "$results/report.md" > /dev/null
echo "bench/train.sh: docs/training.md, docs/training-*.png and $results/report.md updated"
