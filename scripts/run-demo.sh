#!/usr/bin/env bash
# The main job. Installs what terse needs, builds it (the C++ library, the `terse` command and
# the Python package), then trains an MLP on Fashion-MNIST with 4 ranks, once with
# DistributedDataParallel's own allreduce and once with terse's DDP hook, on PyTorch 2.x (the
# project's virtual environment), and prints a table side by side (python/terse/demo.py). As
# root each rank runs on its own emulated host behind 1 Gbit/s links; elsewhere over loopback.
# The demo's options pass through, e.g. --codec fp16 or --link 100mbit.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh build release
mkdir -p results
python=${TERSE_DEMO_PYTHON:-${TERSE_VENV:-/opt/terse/venv}/bin/python}
PYTHONPATH="$PWD/build/python" "$python" -m terse.demo --json results/demo.json "$@"
