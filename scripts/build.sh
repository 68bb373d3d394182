#!/usr/bin/env bash
# Configures and builds terse into build/ (Release) or the directory and flavour given.
#   scripts/build.sh                 -> build/          optimized
#   scripts/build.sh build-asan asan -> build-asan/     AddressSanitizer + UBSan
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
flavour=${2:-release}
args=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
case "$flavour" in
  release) ;;
  asan) args=(-G Ninja -DCMAKE_BUILD_TYPE=Debug -DTERSE_SANITIZE=ON
              -DCMAKE_CXX_FLAGS=-O1) ;;
  fuzz) args=(-G Ninja -DCMAKE_BUILD_TYPE=Debug -DTERSE_FUZZ=ON -DTERSE_TESTS=OFF -DTERSE_SANITIZE=ON
              -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS=-O1) ;;
  *) echo "unknown flavour $flavour" >&2; exit 2 ;;
esac
cmake -S . -B "$dir" "${args[@]}" >/dev/null
cmake --build "$dir" -j "$(nproc)"
