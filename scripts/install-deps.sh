#!/usr/bin/env bash
# Installs every Debian 12 package terse needs to build, test, benchmark and run its demo, and
# the virtual environment with PyTorch 2.x from PyPI (scripts/requirements.txt).
# Idempotent; safe to run on a fresh machine as root (or with sudo available).
set -euo pipefail

packages=(
  # build
  build-essential cmake ninja-build pkg-config clang libclang-rt-14-dev
  # libraries
  libhwy-dev libgloo-dev libcli11-dev nlohmann-json3-dev libfmt-dev libssl-dev
  libopenblas-dev libopenblas0-pthread
  libgtest-dev libgmock-dev libbenchmark-dev pybind11-dev
  # python side: Debian's torch, tests, plots
  python3 python3-dev python3-venv python3-torch python3-pytest python3-numpy python3-matplotlib
  # data (Fashion-MNIST, the language model's text) and cluster emulation
  dataset-fashion-mnist fortunes iproute2 iperf3
)

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} Debian packages present"
else
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The virtual environment with PyTorch 2.x (scripts/requirements.txt), made once per machine
# outside the checkout so that every clone and CI run reuses it: torch is several GB. It is
# brought up to date only when the requirements change (their digest is kept in the venv).
venv=${TERSE_VENV:-/opt/terse/venv}
requirements="$(cd "$(dirname "$0")" && pwd)/requirements.txt"
digest=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.terse-requirements" 2>/dev/null)" = "$digest" ]; then
  echo "install-deps: $venv is up to date ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
  exit 0
fi
# An existing venv gets only what changed: pip keeps installed packages that meet the pins
# (torch is not downloaded again when only other lines changed).
if [ -x "$venv/bin/python" ]; then
  echo "install-deps: bringing $venv up to date with $requirements"
else
  echo "install-deps: making $venv from $requirements (torch from PyPI: several GB the first time)"
  "${sudo_cmd[@]}" mkdir -p "$(dirname "$venv")"
  "${sudo_cmd[@]}" /usr/bin/python3 -m venv "$venv"
fi
"${sudo_cmd[@]}" "$venv/bin/pip" install -q --disable-pip-version-check -r "$requirements"
echo "$digest" | "${sudo_cmd[@]}" tee "$venv/.terse-requirements" >/dev/null
echo "install-deps: $venv ready ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
