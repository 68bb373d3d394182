#!/usr/bin/env bash
# The install_pip test: `pip install .` of this checkout into a throwaway virtual environment,
# then, from another directory and without PYTHONPATH or LD_LIBRARY_PATH, the installed `terse`
# command (its built-in models too), `import terse, terse.torch`, that the package holds neither
# the benchmark harness nor scripts/cluster.sh, and `python -m terse.demo --help`.
#   tests/install/pip_install.sh WORK_DIR
# The environment sees the system's packages (Debian's torch 1.13 and numpy: nothing large to
# download) and gets the pinned build requirements (scripts/requirements-build.txt) from PyPI
# or pip's cache, so that pip builds without isolation. WORK_DIR/build keeps scikit-build-core's
# CMake build between runs, and ccache, where present, serves a fresh one. Warnings are errors
# here, as in CI's other builds (pyproject.toml turns them off for users).
set -euo pipefail
source_dir=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:?usage: $0 WORK_DIR}
python=${TERSE_INSTALL_PYTHON:-/usr/bin/python3}

rm -rf "$work/venv" "$work/elsewhere"
mkdir -p "$work/elsewhere"
"$python" -m venv --system-site-packages "$work/venv"
venv=$(cd "$work/venv" && pwd)
"$venv/bin/pip" install -q --disable-pip-version-check \
  -r "$source_dir/scripts/requirements-build.txt"

settings=(--config-settings=build-dir="$work/build"
          --config-settings=cmake.define.TERSE_WERROR=ON)
if command -v ccache >/dev/null; then
  settings+=(--config-settings=cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
start=$(date +%s)
"$venv/bin/pip" install -q --disable-pip-version-check --no-build-isolation "${settings[@]}" \
  "$source_dir"
echo "install_pip: pip install . took $(($(date +%s) - start)) s"

cd "$work/elsewhere"
unset PYTHONPATH LD_LIBRARY_PATH
export PATH="$venv/bin:$PATH"
fail() { echo "install_pip: $*" >&2; exit 1; }

[ "$(command -v terse)" = "$venv/bin/terse" ] || fail "terse is $(command -v terse), not $venv/bin/terse"
terse --help >/dev/null || fail "terse --help failed"
terse codecs | grep -q '^powersgd ' || fail "terse codecs lists no powersgd"
python -c "import terse, terse.torch" || fail "import terse, terse.torch failed"
python - "$venv" <<'PY' || fail "the installed package is not self-contained"
import os, sys
import terse
from terse import _paths
venv = os.path.realpath(sys.argv[1])
where = os.path.realpath(terse.__file__)
assert where.startswith(venv + os.sep), f"terse imported from {where}"
assert os.path.realpath(_paths.TERSE_CLI) == os.path.join(venv, "bin", "terse"), _paths.TERSE_CLI
package = os.path.dirname(where)
assert _paths.CLUSTER_SCRIPT is None, _paths.CLUSTER_SCRIPT
for harness in ("cluster.sh", "training.py", "pipeline_bench.py", "data.py"):
    assert not os.path.exists(os.path.join(package, harness)), f"the package ships {harness}"
print(f"terse {terse.__version__} from {os.path.dirname(where)}, {len(terse.codecs())} codecs")
PY
python -m terse.demo --help >/dev/null || fail "python -m terse.demo --help failed"
terse plan --pipeline --help >/dev/null || fail "terse plan --pipeline --help failed"
terse plan --model vgg --ranks 4 --bandwidth 1gbit --write-sizes vgg.json --sizes-only \
  || fail "terse plan --model vgg failed"
grep -q '"features.0.weight"' vgg.json || fail "terse plan --model vgg wrote no VGG-11 sizes"
echo "install_pip: ok"
