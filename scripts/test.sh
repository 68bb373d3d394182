#!/usr/bin/env bash
# Builds terse and runs every test: the optimized build, the same tests under AddressSanitizer
# and UndefinedBehaviorSanitizer, and each decoder's fuzz target for a bounded time.
# Installs the Debian packages it needs first. Exits non-zero if anything fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh

echo "== optimized build and tests (C++, the pytest suites python_*, install_consumer, install_pip)"
bash scripts/build.sh build release
ctest --test-dir build --output-on-failure -j 2

echo "== AddressSanitizer + UndefinedBehaviorSanitizer build and tests"
# No Python tests here: an ASan-instrumented extension cannot load into the uninstrumented
# /usr/bin/python3 without LD_PRELOAD, and would then report the interpreter's own allocations.
# CMake skips the package under TERSE_SANITIZE; the C++ it wraps is what these suites test.
bash scripts/build.sh build-asan asan
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j 2

if [ -f fuzz/CMakeLists.txt ]; then
  echo "== fuzz targets (${TERSE_FUZZ_SECONDS:-10} s each)"
  bash scripts/build.sh build-fuzz fuzz
  bash scripts/fuzz.sh build-fuzz "${TERSE_FUZZ_SECONDS:-10}"
fi
echo "== all tests passed"
