#!/usr/bin/env bash
# The pipeline benchmark of docs/pipeline.md: 4-stage pipelines (MLP and CNN on Fashion-MNIST,
# a small transformer on synthetic sequences) with every boundary compressed by each codec, a
# learned autoencoder or AQ-SGD's delta method, on the emulated 4-host cluster (one stage per
# host) with unshaped, 1 Gbit/s and 100 Mbit/s links. Throughput (median step), test accuracy
# after a fixed budget, bytes, and the cost model's prediction made before each run.
#
#   bash bench/pipeline.sh [--links "unshaped 1gbit 100mbit"] [--models "mlp cnn transformer"]
#                          [--out results/pipeline] [--redo]
#
# Resumable: each (link, model, compressor) cell has its own JSON under --out and is skipped
# when present, so the grid can be run one link rate at a time. Ends with the report: markdown
# tables (OUT/tables.md), OUT/summary.json and docs/pipeline-*.png. Needs root (network
# namespaces); builds terse first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh build release >/dev/null
export PYTHONPATH="$PWD/build/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
out=results/pipeline
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [ "${args[$i]}" = --out ] && out=${args[$((i + 1))]}
done
/usr/bin/python3 bench/pipeline_grid.py run "$@"
/usr/bin/python3 bench/pipeline_grid.py report --out "$out" --docs docs
