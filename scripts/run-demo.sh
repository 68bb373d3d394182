#!/usr/bin/env bash
# The main job. Installs what terse needs, builds it (the C++ library, the `terse` command and
# the Python package), then trains an MLP on Fashion-MNIST with 4 local ranks, once with
# DistributedDataParallel's own allreduce and once with terse's DDP hook, and prints a table
# side by side (python/terse/demo.py; its options pass through, e.g. --codec fp16).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh build release
mkdir -p results
# Debian's torch imports only into /usr/bin/python3.
PYTHONPATH="$PWD/build/python" /usr/bin/python3 -m terse.demo --json results/demo.json "$@"
