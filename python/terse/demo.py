"""The terse demo: data-parallel training of a real model on Fashion-MNIST, once with
DistributedDataParallel's own allreduce and once with the terse hook, side by side.

    python -m terse.demo [--ranks 4] [--codec powersgd:rank=8] [--samples 60000] [--epochs 1]
                         [--link 1gbit|100mbit|unshaped|loopback]

By default every rank sits on its own emulated host behind 1 Gbit/s links in each direction
(scripts/cluster.sh of terse's source tree: network namespaces, a bridge and tbf shaping), the
setting terse is made for: the bytes each step sends decide its time, as on a cluster of
machines. That needs root and a build tree (the installed package does not carry the script);
where hosts cannot be emulated the demo says why and runs over loopback instead, where bytes
are nearly free and the step time is mostly the computation the ranks share two cores for.

The driver starts each run's ranks on this machine (``terse run``, or scripts/cluster.sh), shows
rank 0's progress, and prints a table: samples/s, median time per step, bytes sent per step and
rank, test accuracy, and whether the replicas ended bit-identical. JSON goes to --json.

Both runs train the same MLP (784-2048-2048-10, 5.8 M parameters) from the same initial weights
on the same batches; only gradient communication differs. This module holds all the demo needs
after ``pip install``: the MLP, a reader of Debian's Fashion-MNIST idx files (numpy only) and
one rank's training loop. The benchmark harness in the source tree (bench/terse_harness) trains
the same MLP, read by the same reader, in its wider comparison (bench/train.py).
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from terse import _paths

BATCH, LR, MOMENTUM = 64, 0.05, 0.9  # per rank; SGD
WARMUP_STEPS = 5  # excluded from the median step time


def mlp():
    """The demo's MLP, 784-2048-2048-10 (its weights from torch's current random state)."""
    import torch.nn as nn

    return nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 10))


# ---- Fashion-MNIST ------------------------------------------------------------------------
# Debian's dataset-fashion-mnist package: idx files, possibly gzip'd.

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"

# Mean and standard deviation of the training images' pixels scaled to [0, 1].
_MEAN, _STD = 0.2860, 0.3530

CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
           "Bag", "Ankle boot")


def _cache_dir() -> str:
    """Where decompressed copies of the dataset's files are kept: TERSE_CACHE_DIR, else
    $XDG_CACHE_HOME/terse, else ~/.cache/terse."""
    return os.environ.get("TERSE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "terse")


def _open_gz(path: str):
    """The decompressed contents of ``path`` (gzip): from a copy in the cache when one exists
    (keyed by the file's name, size and time), else decompressed and the copy written (to a
    temporary name, then renamed: concurrent ranks each see a whole copy or none). Decompressing
    the training images takes a worker 0.2 s on an idle core, more where training workers hold
    the cores; reading the copy, a few milliseconds. Where the cache cannot be written, the data
    still loads."""
    st = os.stat(path)
    name = f"{os.path.basename(path)[:-3]}-{st.st_size}-{st.st_mtime_ns}"
    cached = os.path.join(_cache_dir(), "fashion-mnist", name)
    try:
        return open(cached, "rb")
    except OSError:
        pass
    with gzip.open(path, "rb") as f:
        data = f.read()
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(cached), delete=False) as f:
            f.write(data)
        os.replace(f.name, cached)
    except OSError:
        pass
    return io.BytesIO(data)


def _open_idx(directory: str, stem: str):
    for name in (stem, stem + ".gz"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return _open_gz(path) if name.endswith(".gz") else open(path, "rb")
    raise FileNotFoundError(
        f"{stem}[.gz] not found in {directory}; install Debian's dataset-fashion-mnist "
        "(scripts/install-deps.sh does) or set TERSE_FASHION_MNIST to a directory holding it")


def _read_idx(directory: str, stem: str, expected_magic: int, limit: Optional[int]) -> np.ndarray:
    with _open_idx(directory, stem) as f:
        header = f.read(4)
        magic = int.from_bytes(header, "big")
        if magic != expected_magic:
            raise ValueError(f"{stem}: idx magic {magic:#x}, expected {expected_magic:#x}")
        ndim = header[3]
        shape = [int.from_bytes(f.read(4), "big") for _ in range(ndim)]
        if limit is not None:
            shape[0] = min(shape[0], limit)
        count = int(np.prod(shape))
        data = np.frombuffer(f.read(count), dtype=np.uint8)
        if data.size != count:
            raise ValueError(f"{stem}: truncated ({data.size} of {count} bytes)")
        return data.reshape(shape)


def load_fashion_mnist(split: str = "train", limit: Optional[int] = None,
                       directory: Optional[str] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(images, labels) of the "train" (60,000) or "test" (10,000) split, the first ``limit``.

    images: float32 [n, 784], normalized to zero mean and unit variance over the training set;
    labels: int64 [n] in 0..9.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    directory = directory or os.environ.get("TERSE_FASHION_MNIST", FASHION_MNIST_DIR)
    prefix = "train" if split == "train" else "t10k"
    images = _read_idx(directory, f"{prefix}-images-idx3-ubyte", 0x803, limit)
    labels = _read_idx(directory, f"{prefix}-labels-idx1-ubyte", 0x801, limit)
    x = images.reshape(images.shape[0], -1).astype(np.float32)
    # In place, in float32: the same values as (x / 255 - mean) / std, without three temporary
    # copies of the 188 MB training set (a second of a worker's start with NumPy 2).
    np.divide(x, 255.0, out=x)
    np.subtract(x, _MEAN, out=x)
    np.divide(x, _STD, out=x)
    return x, labels.astype(np.int64)


# ---- one rank -------------------------------------------------------------------------------


def interface_tx_bytes(ifname: Optional[str]) -> Optional[int]:
    """Bytes the kernel has sent on interface ``ifname`` of this network namespace, or None."""
    if not ifname:
        return None
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == ifname:
                return int(rest.split()[8])  # receive: 8 fields, then transmit bytes
    return None


def _digest(module: Any) -> str:
    """SHA-256 of every parameter's bytes, in order: equal digests mean bit-identical replicas."""
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _evaluate(module: Any, x_test: Any, y_test: Any, rank: int, world: int) -> float:
    """Test accuracy over all test images: each rank scores every world-th one, and the counts
    are summed over the ranks."""
    import torch
    import torch.distributed as dist

    module.eval()
    correct = 0
    share = torch.arange(rank, len(x_test), world)
    with torch.no_grad():
        for chunk in share.split(1000):
            correct += int((module(x_test[chunk]).argmax(1) == y_test[chunk]).sum())
    module.train()
    counts = torch.tensor([float(correct), float(len(share))], dtype=torch.float64)
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def _rank(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """One rank of a run (torch.distributed's environment; TERSE_IFNAME names the interface
    whose bytes are counted): trains the MLP with DDP (method "ddp") or DDP with the terse hook
    of ``args.codec`` ("terse"). Returns rank 0's figures (None elsewhere)."""
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    started = time.perf_counter()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = (torch.from_numpy(a) for a in load_fashion_mnist("train", limit=args.samples))
    x_test, y_test = (torch.from_numpy(a) for a in load_fashion_mnist("test"))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(mlp())
    state = None
    if args.rank_of == "terse":
        import terse.torch

        state, hook = terse.torch.ddp_hook(model, codec=args.codec, threads=args.threads,
                                           timeout=args.timeout)
        model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    parameters = sum(p.numel() for p in model.parameters())
    ifname = os.environ.get("TERSE_IFNAME")
    counted = interface_tx_bytes(ifname) is not None

    def sent() -> Tuple[int, int]:
        return (interface_tx_bytes(ifname) if counted else 0,
                state.bytes_sent if state is not None else 0)

    steps_per_epoch = len(x) // (BATCH * world)
    total = steps_per_epoch * args.epochs
    if total == 0:
        raise ValueError("too few samples for one global batch")
    progress_every = max(1, total // 10)
    label = args.label
    if rank == 0:
        print(f"[{label}] {world} ranks connected, data ready "
              f"({time.perf_counter() - started:.1f} s); {total} steps of {BATCH * world} samples",
              flush=True)
    times: List[float] = []  # step seconds after warm-up
    marks = sent()
    loss_sum, loss_count, step = 0.0, 0, 0
    for epoch in range(args.epochs):
        # The same permutation on every rank; each takes its slice of every global batch.
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(steps_per_epoch):
            if step == WARMUP_STEPS:
                marks = sent()
            start = i * BATCH * world + rank * BATCH
            index = order[start:start + BATCH]
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x[index]), y[index])
            loss.backward()
            optimizer.step()
            if step >= WARMUP_STEPS:
                times.append(time.perf_counter() - t0)
            loss_sum += loss.item()
            loss_count += 1
            step += 1
            if rank == 0 and (step % progress_every == 0 or step == total):
                rate = (f"{BATCH * world / statistics.median(times):,.0f} samples/s" if times
                        else "warming up")
                print(f"[{label}] step {step}/{total} loss {loss_sum / loss_count:.3f} {rate}",
                      flush=True)
                loss_sum, loss_count = 0.0, 0
    now = sent()
    wire, payload = now[0] - marks[0], now[1] - marks[1]
    accuracy = _evaluate(model.module, x_test, y_test, rank, world)
    if rank == 0:
        print(f"[{label}] step {step}/{total} epoch {step / steps_per_epoch:.2f}: test accuracy "
              f"{100 * accuracy:.2f} %", flush=True)
    mine = {"wire": wire / len(times) if counted and times else None,
            "payload": payload / len(times) if state is not None and times else None,
            "digest": _digest(model.module)}
    everyone: List[Optional[Dict[str, Any]]] = [None] * world
    dist.all_gather_object(everyone, mine)
    if state is not None:
        state.close()
    result = None
    if rank == 0:
        def mean(key: str) -> Optional[float]:
            values = [r[key] for r in everyone]
            return None if any(v is None for v in values) else sum(values) / len(values)

        median = statistics.median(times) if times else None
        result = {
            "label": label, "method": args.rank_of, "codec": args.codec, "ranks": world,
            "batch_per_rank": BATCH, "global_batch": BATCH * world, "lr": LR,
            "momentum": MOMENTUM, "parameters": parameters, "gradient_bytes": parameters * 4,
            "train_samples": len(x), "steps": total, "timed_steps": len(times),
            "samples_per_second": BATCH * world / median if median else None,
            "median_step_seconds": median, "test_accuracy": accuracy,
            "wire_bytes_per_step": mean("wire"), "payload_bytes_per_step": mean("payload"),
            "interface": ifname, "replicas_identical": len({r["digest"] for r in everyone}) == 1,
            "torch_version": torch.__version__.split("+")[0],
        }
    # DDP's reducer holds the process group: if it outlived destroy_process_group(), its
    # destructor would join Gloo's threads while holding the GIL, which a thread still freeing a
    # tensor waits for (a torch 1.13 deadlock at exit). So the model goes first.
    del model, optimizer, state
    gc.collect()
    dist.destroy_process_group()
    return result


# ---- the driver -----------------------------------------------------------------------------


def emulated_hosts_unavailable(script: Optional[str] = None) -> Optional[str]:
    """None if this process can emulate hosts with scripts/cluster.sh (``script``, default: the
    one a build tree's package knows in the source tree; root, network namespaces, tc's tbf),
    else why not. Tries a one-host cluster: about a second."""
    script = script or _paths.CLUSTER_SCRIPT
    if not script:
        return ("emulated hosts need scripts/cluster.sh of terse's source tree, which the "
                "installed package does not carry (scripts/run-demo.sh runs the demo there)")
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces and tc)"
    try:
        probe = subprocess.run(["bash", script, "-n", "1", "-r", "1gbit", "-p", "29499", "--",
                                "true"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"scripts/cluster.sh could not run: {e}"
    if probe.returncode != 0:
        last = (probe.stdout.strip().splitlines() or ["no output"])[-1]
        return f"scripts/cluster.sh failed: {last}"
    return None


def _launch(method: str, label: str, args: argparse.Namespace, out: str) -> Dict[str, Any]:
    """Runs one method's ranks (``terse run`` over loopback, or one emulated host each) and
    returns rank 0's result, with ``wall_seconds``."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=python_path)
    # torch 2.x's c10d warns on every rank of an emulated host that the client socket's host name
    # cannot be looked up (the namespaces have no resolver); nothing depends on it.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    worker = [sys.executable, "-m", "terse.demo", "--rank-of", method, "--label", label,
              "--codec", args.codec, "--threads", str(args.threads), "--samples",
              str(args.samples), "--epochs", str(args.epochs), "--timeout", str(args.timeout),
              "--json", out]
    if args.link:
        # torch's Gloo must bind the namespace's eth0 (terse gets TERSE_IFNAME=eth0 from
        # cluster.sh); the environment is passed through env(1).
        cmd = ["bash", _paths.CLUSTER_SCRIPT, "-n", str(args.ranks), "-r", args.link, "--",
               "env", f"PYTHONPATH={python_path}", "OMP_NUM_THREADS=1", "PYTHONUNBUFFERED=1",
               "GLOO_SOCKET_IFNAME=eth0", f"TERSE_TIMEOUT={args.timeout}", *worker]
        rank0 = "[host 0] "
    else:
        cmd = [_paths.TERSE_CLI, "run", "-n", str(args.ranks), "--timeout", str(args.timeout),
               "--", *worker]
        rank0 = "[rank 0] "
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    lines: List[str] = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(rank0):
            print(line[len(rank0):], end="", flush=True)
    status = proc.wait()
    if status != 0 or not os.path.exists(out):
        tail = "".join(lines[-40:])
        raise SystemExit(f"terse demo: {label}: the run failed (exit status {status}); last "
                         f"output:\n{tail}")
    with open(out) as f:
        result = json.load(f)
    result["wall_seconds"] = time.perf_counter() - start
    result["link"] = args.link or "loopback"
    return result


def _run(label: str, method: str, args: argparse.Namespace, out: str) -> Dict:
    where = f"one emulated host each, {args.link} links" if args.link else "loopback"
    print(f"== {label}: {args.ranks} ranks, {where}", flush=True)
    result = _launch(method, label, args, out)
    if result["wire_bytes_per_step"] is not None:
        result["bytes_per_step"], result["bytes_how"] = result["wire_bytes_per_step"], "eth0"
    elif result["payload_bytes_per_step"] is not None:
        result["bytes_per_step"], result["bytes_how"] = result["payload_bytes_per_step"], "counted"
    else:
        # Gloo's ring allreduce sends 2 (N-1)/N of every bucket from every rank.
        world = result["ranks"]
        result["bytes_per_step"] = 2 * (world - 1) / world * result["gradient_bytes"]
        result["bytes_how"] = "ring model"
    return result


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} GB"


def _table(results: List[Dict]) -> str:
    rows = [
        ("", [r["label"] for r in results]),
        ("samples/s", [f"{r['samples_per_second']:,.0f}" for r in results]),
        ("time per step (median)", [
            f"{1000 * r['median_step_seconds']:.1f} ms" for r in results]),
        ("bytes sent per step and rank", [
            f"{_human_bytes(r['bytes_per_step'])} ({r['bytes_how']})" for r in results]),
        ("  vs fp32 gradient", [
            f"{r['bytes_per_step'] / r['gradient_bytes']:.3f}x" for r in results]),
        ("test accuracy", [f"{100 * r['test_accuracy']:.2f} %" for r in results]),
        ("replicas bit-identical", ["yes" if r["replicas_identical"] else "NO" for r in results]),
        ("wall time of the run", [f"{r['wall_seconds']:.0f} s" for r in results]),
    ]
    first = max(len(name) for name, _ in rows)
    widths = [max(len(row[1][i]) for row in rows) for i in range(len(results))]
    lines = []
    for k, (name, cells) in enumerate(rows):
        lines.append("  ".join([name.ljust(first)] + [c.rjust(w) for c, w in zip(cells, widths)]))
        if k == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m terse.demo",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--ranks", type=int, default=4, help="local ranks (default 4)")
    p.add_argument("--codec", default="powersgd:rank=8",
                   help="terse codec for the weight matrices (default powersgd:rank=8, the "
                        "hook's default)")
    p.add_argument("--samples", type=int, default=60000,
                   help="training images used, of 60,000 (default all)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--threads", type=int, default=1,
                   help="terse worker threads per rank (default 1: ranks share the cores)")
    p.add_argument("--timeout", type=float, default=120,
                   help="communication timeout in seconds (TERSE_TIMEOUT)")
    p.add_argument("--link", default="auto",
                   help="each rank on its own emulated host behind links of this rate "
                        "(1gbit, 100mbit, unshaped; needs root: network namespaces and tc), or "
                        "loopback; default auto: 1gbit where hosts can be emulated, else "
                        "loopback")
    p.add_argument("--json", default="results/demo.json", help="where to write the results")
    # One rank of a run, as the driver starts it: its method, and the label its lines carry.
    p.add_argument("--rank-of", choices=["ddp", "terse"], help=argparse.SUPPRESS)
    p.add_argument("--label", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_of:
        result = _rank(args)
        if result is not None:
            with open(args.json, "w") as f:
                json.dump(result, f)
        return

    load_fashion_mnist("test", limit=1)  # fail early, with the fix, if the data is missing
    import torch

    why_not = None if args.link == "loopback" else emulated_hosts_unavailable()
    if args.link == "auto":
        args.link = "" if why_not else "1gbit"
    elif args.link == "loopback":
        args.link = ""
    elif why_not:
        raise SystemExit(f"terse demo: --link {args.link}: {why_not}")
    if why_not and not args.link:
        print(f"terse demo: running over loopback: {why_not}", flush=True)
    args.samples = min(args.samples, 60000)
    subset = args.samples < 60000 or args.epochs != 1
    print(f"terse demo: MLP 784-2048-2048-10 on Fashion-MNIST, {args.ranks} local ranks, "
          f"batch {BATCH} per rank, SGD lr {LR} momentum {MOMENTUM}; "
          f"{args.samples:,} training images x {args.epochs} epoch(s)"
          f"{' (a subset: use --samples 60000 --epochs 1 for the full epoch)' if subset else ''}; "
          f"test accuracy on all 10,000 test images. Timing excludes the first "
          f"{WARMUP_STEPS} steps. PyTorch {torch.__version__}. Links: "
          f"{args.link + ' (one emulated host per rank)' if args.link else 'loopback'}.",
          flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="terse-demo-") as tmp:
        results.append(_run("DDP allreduce", "ddp", args, os.path.join(tmp, "ddp.json")))
        results.append(_run(f"terse {args.codec}", "terse", args, os.path.join(tmp, "terse.json")))
    print()
    print(_table(results))
    print()
    if args.link:
        print("Bytes: what each rank's eth0 sent (TCP/IP included), mean over ranks.")
        print(f"Every rank sat on its own emulated host with {args.link} links; the ranks still "
              "share this machine's cores for computation.")
    else:
        print("Bytes: over loopback nothing is counted per rank, so DDP's follow from Gloo's "
              "ring (2 (N-1)/N of the gradient per step and rank) and terse counts what it sent.")
        print("The ranks share this machine's cores and talk over loopback, so time per step is "
              "mostly computation here; over a network link the bytes decide it (as root, the "
              "demo puts each rank on its own host behind 1 Gbit/s links).")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"runs": results}, f, indent=2)
        print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
