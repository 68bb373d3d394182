"""The terse demo: data-parallel training of a real model on Fashion-MNIST, once with
DistributedDataParallel's own allreduce and once with the terse hook, side by side.

    python3 -m terse.demo [--ranks 4] [--codec powersgd] [--samples 60000] [--epochs 1]
                          [--link 1gbit]

The driver starts each run's ranks on this machine with `terse run` (torchrun's environment),
shows rank 0's progress, and prints a table: samples/s, time per step, bytes sent per step and
rank, test accuracy, and whether the replicas ended bit-identical. JSON goes to --json.

By default the ranks talk over loopback, where bytes are nearly free and the ranks share two
cores, so the step time is mostly computation. --link RATE (root) puts every rank on its own
emulated host behind a link of RATE in each direction (scripts/cluster.sh: network namespaces,
a bridge and tbf shaping), where the bytes sent decide the step time as on a real cluster.

Both runs train the same MLP (784-2048-2048-10, 5.8 M parameters) from the same initial weights
on the same batches; only gradient communication differs.
"""

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

BATCH = 64  # per rank
LR = 0.05
MOMENTUM = 0.9
WARMUP_STEPS = 5  # excluded from timing: first touch of buffers, DDP's bucket rebuild, checks


# ---- one rank -------------------------------------------------------------------------------

def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(784, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 10))


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from terse.data import load_fashion_mnist

    started = time.perf_counter()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x_np, y_np = load_fashion_mnist("train", limit=args.samples)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    xt_np, yt_np = load_fashion_mnist("test")
    x_test, y_test = torch.from_numpy(xt_np), torch.from_numpy(yt_np)

    model = DDP(_model())
    state = None
    if args.mode == "terse":
        import terse.torch

        state, hook = terse.torch.ddp_hook(model, codec=args.codec, threads=args.threads)
        model.register_comm_hook(state, hook)
        del hook
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    parameters = sum(p.numel() for p in model.parameters())

    if rank == 0:
        setup = time.perf_counter() - started
        print(f"[{args.label}] ranks connected, data loaded ({setup:.1f} s)", flush=True)
    global_batch = BATCH * world
    steps_per_epoch = len(x) // global_batch
    total = steps_per_epoch * args.epochs
    report_every = max(1, total // 10)
    label = args.label
    step = 0
    timed_start = time.perf_counter()
    bytes_at_start = 0
    loss_sum, loss_count = 0.0, 0
    for epoch in range(args.epochs):
        # The same permutation on every rank; each takes its slice of every global batch.
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(steps_per_epoch):
            if step == WARMUP_STEPS:
                timed_start = time.perf_counter()
                bytes_at_start = state.bytes_sent if state else 0
            index = order[i * global_batch + rank * BATCH:i * global_batch + (rank + 1) * BATCH]
            optimizer.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x[index]), y[index])
            loss.backward()
            optimizer.step()
            loss_sum += loss.item()
            loss_count += 1
            step += 1
            if rank == 0 and (step % report_every == 0 or step == total):
                elapsed = time.perf_counter() - timed_start
                rate = (step - WARMUP_STEPS) * global_batch / elapsed if step > WARMUP_STEPS else 0
                print(f"[{label}] epoch {epoch + 1}/{args.epochs} step {step}/{total} "
                      f"loss {loss_sum / loss_count:.3f} {rate:,.0f} samples/s", flush=True)
                loss_sum, loss_count = 0.0, 0
    seconds = time.perf_counter() - timed_start
    timed_steps = total - WARMUP_STEPS

    # Test accuracy: each rank scores its share of the 10,000 test images.
    if rank == 0:
        print(f"[{args.label}] evaluating on the test set", flush=True)
    model.eval()
    share = torch.arange(rank, len(x_test), world)
    with torch.no_grad():
        correct = (model.module(x_test[share]).argmax(1) == y_test[share]).sum()
    counts = torch.tensor([float(correct), float(len(share))])
    dist.all_reduce(counts)

    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    digests: List[Optional[str]] = [None] * world
    dist.all_gather_object(digests, digest.hexdigest())

    if state is not None:
        bytes_per_step = (state.bytes_sent - bytes_at_start) / timed_steps
        bytes_how = "measured"
        plan = [(name, n, p.codec, p.strategy) for name, n, p in state.plan()]
        state.close()
    else:
        # Gloo's ring allreduce sends 2 (N-1)/N of every bucket from every rank.
        bytes_per_step = 2 * (world - 1) / world * parameters * 4
        bytes_how = "ring model"
        plan = []
    if rank == 0:
        result = {
            "label": label, "mode": args.mode, "codec": args.codec if state else "ddp",
            "ranks": world, "batch_per_rank": BATCH, "train_samples": len(x),
            "epochs": args.epochs, "steps": total, "timed_steps": timed_steps,
            "seconds": seconds, "samples_per_second": timed_steps * global_batch / seconds,
            "seconds_per_step": seconds / timed_steps, "bytes_per_step": bytes_per_step,
            "bytes_how": bytes_how, "gradient_bytes": parameters * 4,
            "test_accuracy": float(counts[0] / counts[1]),
            "replicas_identical": len(set(digests)) == 1, "plan": plan,
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    # DDP's reducer holds the process group: if it outlived destroy_process_group(), its
    # destructor would join Gloo's threads while holding the GIL, which a thread still freeing a
    # tensor waits for (a torch 1.13 deadlock at exit). So the model goes first.
    del model, optimizer, state
    gc.collect()
    dist.destroy_process_group()


# ---- the driver -----------------------------------------------------------------------------

def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} GB"


def _run(label: str, mode: str, args: argparse.Namespace, out: str) -> Dict:
    from terse import _paths

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    worker = [sys.executable, "-m", "terse.demo", "--worker", "--mode", mode, "--label", label,
              "--codec", args.codec, "--samples", str(args.samples), "--epochs",
              str(args.epochs), "--threads", str(args.threads), "--out", out]
    if args.link:
        # Each rank in its own namespace: torch's Gloo must bind the namespace's eth0 (terse
        # gets TERSE_IFNAME=eth0 from cluster.sh); the environment is passed through env(1).
        cluster = os.path.join(_paths.SOURCE_DIR, "scripts", "cluster.sh")
        cmd = ["bash", cluster, "-n", str(args.ranks), "-r", args.link, "--", "env",
               f"PYTHONPATH={env['PYTHONPATH']}", "OMP_NUM_THREADS=1", "PYTHONUNBUFFERED=1",
               "GLOO_SOCKET_IFNAME=eth0", f"TERSE_TIMEOUT={args.timeout}", *worker]
        where = f"one emulated host each, {args.link} links"
    else:
        cmd = [_paths.TERSE_CLI, "run", "-n", str(args.ranks), "--timeout", str(args.timeout),
               "--", *worker]
        where = "loopback"
    print(f"== {label}: {args.ranks} ranks, {where}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"terse demo: the {label} run failed (exit status {proc.returncode})")
    with open(out) as f:
        result = json.load(f)
    result["wall_seconds"] = time.perf_counter() - start
    return result


def _table(results: List[Dict]) -> str:
    rows = [
        ("", [r["label"] for r in results]),
        ("samples/s", [f"{r['samples_per_second']:,.0f}" for r in results]),
        ("time per step", [f"{1000 * r['seconds_per_step']:.1f} ms" for r in results]),
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
    p = argparse.ArgumentParser(prog="python3 -m terse.demo",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--ranks", type=int, default=4, help="local ranks (default 4)")
    p.add_argument("--codec", default="powersgd",
                   help="terse codec for the weight matrices (default powersgd: rank 4)")
    p.add_argument("--samples", type=int, default=60000,
                   help="training images used, of 60,000 (default all)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--threads", type=int, default=1,
                   help="terse worker threads per rank (default 1: ranks share the cores)")
    p.add_argument("--timeout", type=float, default=120,
                   help="communication timeout in seconds (TERSE_TIMEOUT)")
    p.add_argument("--link", default="",
                   help="emulate a network link of this rate between the ranks, e.g. 1gbit "
                        "(needs root: network namespaces and tc; default: loopback)")
    p.add_argument("--json", default="results/demo.json", help="where to write the results")
    # Internal: one rank of a run.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["ddp", "terse"], help=argparse.SUPPRESS)
    p.add_argument("--label", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return

    from terse.data import load_fashion_mnist

    load_fashion_mnist("test", limit=1)  # fail early, with the fix, if the data is missing
    if args.link and os.geteuid() != 0:
        raise SystemExit("terse demo: --link needs root (network namespaces and tc)")
    args.samples = min(args.samples, 60000)
    subset = args.samples < 60000 or args.epochs != 1
    print(f"terse demo: MLP 784-2048-2048-10 on Fashion-MNIST, {args.ranks} local ranks, "
          f"batch {BATCH} per rank, SGD lr {LR} momentum {MOMENTUM}; "
          f"{args.samples:,} training images x {args.epochs} epoch(s)"
          f"{' (a subset: use --samples 60000 --epochs 1 for the full epoch)' if subset else ''}; "
          f"test accuracy on all 10,000 test images. Timing excludes the first "
          f"{WARMUP_STEPS} steps. Links: {args.link or 'loopback'}.", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="terse-demo-") as tmp:
        results.append(_run("DDP allreduce", "ddp", args, os.path.join(tmp, "ddp.json")))
        results.append(_run(f"terse {args.codec}", "terse", args, os.path.join(tmp, "terse.json")))
    print()
    print(_table(results))
    print()
    print("Bytes for DDP follow from Gloo's ring (2 (N-1)/N of the gradient per step and rank); "
          "terse counts what it sent.")
    if args.link:
        print(f"Every rank sat on its own emulated host with {args.link} links; the ranks still "
              "share this machine's cores for computation.")
    else:
        print("The ranks share this machine's cores and talk over loopback, so time per step is "
              "mostly computation here; over a network link the bytes decide it (try --link "
              "1gbit as root).")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"runs": results}, f, indent=2)
        print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
