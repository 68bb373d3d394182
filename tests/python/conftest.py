"""Shared helpers of the Python tests: where the build is, and launching multi-process runs.

CTest runs these tests with PYTHONPATH=<build>/python:<source>/bench (the package, then the
benchmark harness terse_harness). Run by hand, `pytest tests/python` finds the package in
build/python and the harness in bench/ of this checkout.
"""

import collections
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
from typing import Dict, List, Optional

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent

try:
    import terse  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO / "build" / "python"))
    import terse  # noqa: F401
try:
    import terse_harness  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO / "bench"))
    import terse_harness  # noqa: F401

# Child processes import the same build of terse, and the same harness.
_package_root = str(pathlib.Path(terse.__file__).resolve().parent.parent)
_harness_root = str(pathlib.Path(terse_harness.__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_package_root, _harness_root]
    + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ["OMP_NUM_THREADS"] = "1"  # the machine has 2 cores; ranks share them

from terse import _paths  # noqa: E402

WORKER = HERE / "ddp_worker.py"
# Ranks run on the interpreter this suite runs on (torch 2.x, or the torch 1.13 leg).
PYTHON = sys.executable
TERSE_CLI = _paths.TERSE_CLI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_results(out: pathlib.Path, n: int) -> List[Dict]:
    results = []
    for r in range(n):
        path = out / f"rank-{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def launch(n: int, args: List[str], out: pathlib.Path, timeout: float = 240,
           worker: pathlib.Path = WORKER) -> List[Dict]:
    """Runs N ranks of a worker (ddp_worker.py) through `terse run`; returns each rank's
    result."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [TERSE_CLI, "run", "-n", str(n), "--", PYTHON, str(worker), *args, "--out", str(out)]
    # codec "auto" calibrates and caches under XDG_CACHE_HOME: keep it out of the user's cache.
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, env=dict(os.environ, XDG_CACHE_HOME=str(out / "cache")))
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}"
    results = read_results(out, n)
    assert all(results), f"a rank wrote no result:\n{proc.stdout}"
    return results


def start_ranks(n: int, args: List[str], out: pathlib.Path,
                env: Optional[Dict[str, str]] = None,
                worker: pathlib.Path = WORKER) -> List[subprocess.Popen]:
    """Starts N ranks with torchrun's environment as separate processes (no launcher that would
    stop the others when one fails)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for r in range(n):
        rank_env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                        WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                        **(env or {}))
        procs.append(subprocess.Popen(
            [PYTHON, str(worker), *args, "--out", str(out)], env=rank_env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


# ---- terse.elastic's workers (elastic_worker.py and its siblings) under `terse run --elastic` --


def run_elastic(worker: pathlib.Path, args: List, *, timeout: float, n: int = 4,
                restarts: int = 1, ok: bool = True, limit: float = 240) -> str:
    """Runs ``worker`` on ``n`` slots under `terse run --elastic`; its output (every rank's lines,
    prefixed "[rank R] "), after checking that the job succeeded (``ok``) or failed."""
    cmd = [str(TERSE_CLI), "run", "--elastic", "--max-restarts", str(restarts), "--timeout",
           str(timeout), "-n", str(n), "--", PYTHON, str(worker), *map(str, args)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=limit)
    assert (proc.returncode == 0) == ok, proc.stdout
    return proc.stdout


def elastic_applied(out: str) -> Dict[int, List]:
    """{step: [(slot, pid, generation, size, time, digest)]} from a data-parallel worker's
    APPLIED lines."""
    steps = collections.defaultdict(list)
    for m in re.finditer(r"\[rank (\d+)\] APPLIED step (\d+) pid (\d+) gen (\d+) size (\d+) "
                         r"at ([\d.]+) digest (\w+)", out):
        slot, step, pid, gen, size = map(int, m.groups()[:5])
        steps[step].append((slot, pid, gen, size, float(m.group(6)), m.group(7)))
    return steps


def elastic_events(out: str, slot: int) -> List[Dict]:
    """The re-formings slot ``slot`` logged (its EVENT lines), in order."""
    return [json.loads(m.group(1))
            for m in re.finditer(rf"\[rank {slot}\] EVENT (\{{.*\}})", out)]


def elastic_pids(out: str, slot: int) -> List[int]:
    """The processes that ran slot ``slot``, in the order they started."""
    return [int(p) for p in re.findall(rf"\[rank {slot}\] STARTED slot {slot} pid (\d+)", out)]
