#!/usr/bin/env bash
# Installs every Debian 12 package terse needs to build, test, benchmark and run its demo.
# Idempotent; safe to run on a fresh machine as root (or with sudo available).
set -euo pipefail

packages=(
  # build
  build-essential cmake ninja-build pkg-config clang libclang-rt-14-dev
  # libraries
  libhwy-dev libgloo-dev libcli11-dev nlohmann-json3-dev libfmt-dev
  libopenblas-dev libopenblas0-pthread
  libgtest-dev libgmock-dev libbenchmark-dev pybind11-dev
  # python side: Debian's torch, tests, plots
  python3 python3-dev python3-torch python3-pytest python3-numpy python3-matplotlib
  # data and cluster emulation
  dataset-fashion-mnist iproute2 iperf3
)

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
