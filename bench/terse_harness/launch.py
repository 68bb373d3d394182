"""The harness's one launcher: starts a worker command as N ranks on this machine, over loopback
with ``terse run`` or each rank on its own emulated host with the repository's
scripts/cluster.sh, and hands back every line the ranks print.

The training runs (terse_harness.training) and the pipeline benchmark (terse_harness.pipeline)
start their ranks through :func:`run`. Ranks import the same terse as this process and this
harness (PYTHONPATH names both), run one OpenMP thread each and print unbuffered.
"""

import os
import subprocess
import sys
import time
from typing import Callable, List, Optional, Tuple

import terse
from terse import _paths, demo

HARNESS_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(HARNESS_ROOT)
# Emulated hosts come from the repository's script (root only: network namespaces and tc).
CLUSTER_SCRIPT = os.path.join(REPO, "scripts", "cluster.sh")
LOOPBACK = ("", "loopback", "local")


def python_path() -> str:
    """PYTHONPATH of a rank: this harness, the terse this process imports, then the caller's."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(terse.__file__)))
    return os.pathsep.join(p for p in (HARNESS_ROOT, package_root,
                                       os.environ.get("PYTHONPATH", "")) if p)


def emulated_hosts_unavailable() -> Optional[str]:
    """None if this process can emulate hosts with the repository's scripts/cluster.sh (root,
    network namespaces, tc's tbf), else why not (the demo's check, on this script)."""
    return demo.emulated_hosts_unavailable(CLUSTER_SCRIPT)


def command(worker: List[str], ranks: int, link: str, timeout: float,
            ranks_per_host: int = 1) -> Tuple[List[str], str]:
    """The command line that starts ``worker`` as ``ranks`` ranks, and the prefix of rank 0's
    output lines.

    ``link`` loopback ("", "loopback" or "local"): local processes (``terse run``). Otherwise
    each rank on its own emulated host with links of that rate, or "unshaped" veth links. On an
    emulated host torch's Gloo must bind the namespace's eth0 (terse gets TERSE_IFNAME=eth0
    from cluster.sh), and the environment passes through env(1).

    ``ranks_per_host`` > 1: hosts of that many consecutive ranks instead of one; emulated hosts
    share their namespace among their ranks (cluster.sh -l), and on loopback the ranks are told
    the layout (TERSE_TOPOLOGY=HxR) since they share one machine and one network.
    """
    if ranks_per_host < 1 or ranks % ranks_per_host != 0:
        raise ValueError(f"{ranks} ranks do not make hosts of {ranks_per_host}")
    hosts = ranks // ranks_per_host
    if link in LOOPBACK:
        layout = ["env", f"TERSE_TOPOLOGY={hosts}x{ranks_per_host}"] if ranks_per_host > 1 else []
        return ([_paths.TERSE_CLI, "run", "-n", str(ranks), "--timeout", str(timeout), "--",
                 *layout, *worker], "[rank 0] ")
    return (["bash", CLUSTER_SCRIPT, "-n", str(hosts), "-l", str(ranks_per_host), "-r", link,
             "--", "env", f"PYTHONPATH={python_path()}", "OMP_NUM_THREADS=1",
             "PYTHONUNBUFFERED=1", "GLOO_SOCKET_IFNAME=eth0", f"TERSE_TIMEOUT={timeout}",
             *worker], "[host 0] " if ranks_per_host == 1 else "[host 0 rank 0] ")


def run(worker: List[str], ranks: int, link: str, timeout: float,
        on_line: Optional[Callable[[str, str], None]] = None,
        ranks_per_host: int = 1) -> Tuple[int, List[str], float]:
    """Runs ``worker`` (a command; ``python_module`` makes one) as ``ranks`` ranks on ``link``
    (see :func:`command`) and waits. Calls ``on_line(line, rank0_prefix)`` for every line the
    ranks print. Returns (exit status, the lines, wall seconds)."""
    cmd, rank0 = command(worker, ranks, link, timeout, ranks_per_host)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=python_path())
    # torch 2.x's c10d warns on every rank of an emulated host that the client socket's host name
    # cannot be looked up (the namespaces have no resolver); nothing depends on it.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    lines: List[str] = []
    for line in proc.stdout:
        lines.append(line)
        if on_line is not None:
            on_line(line, rank0)
    status = proc.wait()
    return status, lines, time.perf_counter() - started


def python_module(module: str, *args: str) -> List[str]:
    """The command of a rank that runs ``python3 -m MODULE ARGS`` on this interpreter."""
    return [sys.executable, "-m", module, *args]

