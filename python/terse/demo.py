"""The terse demo: data-parallel training of a real model on Fashion-MNIST, once with
DistributedDataParallel's own allreduce and once with the terse hook, side by side.

    python -m terse.demo [--ranks 4] [--codec powersgd:rank=8] [--samples 60000] [--epochs 1]
                         [--link 1gbit|100mbit|unshaped|loopback]

By default every rank sits on its own emulated host behind 1 Gbit/s links in each direction
(scripts/cluster.sh: network namespaces, a bridge and tbf shaping), the setting terse is made
for: the bytes each step sends decide its time, as on a cluster of machines. That needs root;
where hosts cannot be emulated the demo says why and runs over loopback instead, where bytes
are nearly free and the step time is mostly the computation the ranks share two cores for.

The driver starts each run's ranks on this machine, shows rank 0's progress, and prints a
table: samples/s, median time per step, bytes sent per step and rank, test accuracy, and
whether the replicas ended bit-identical. JSON goes to --json.

Both runs train the same MLP (784-2048-2048-10, 5.8 M parameters) from the same initial weights
on the same batches; only gradient communication differs. The model, data and training loop are
terse.training's, which the training benchmark (bench/train.py) uses for its wider comparison.
"""

import argparse
import json
import os
import tempfile
from typing import Dict, List, Optional

from terse.training import MODELS, RunConfig, emulated_hosts_unavailable, launch

MODEL = MODELS["mlp"]


# ---- the driver -----------------------------------------------------------------------------

def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} GB"


def _run(label: str, method: str, args: argparse.Namespace, out: str) -> Dict:
    config = RunConfig(model="mlp", method=method, codec=args.codec, threads=args.threads,
                       epochs=args.epochs, samples=args.samples, timeout=args.timeout,
                       label=label)
    where = f"one emulated host each, {args.link} links" if args.link else "loopback"
    print(f"== {label}: {args.ranks} ranks, {where}", flush=True)
    try:
        result = launch(config, out, ranks=args.ranks, link=args.link)
    except RuntimeError as e:
        raise SystemExit(f"terse demo: {e}")
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
    args = p.parse_args(argv)

    from terse.data import load_fashion_mnist

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
          f"batch {MODEL.batch} per rank, SGD lr {MODEL.lr} momentum {MODEL.momentum}; "
          f"{args.samples:,} training images x {args.epochs} epoch(s)"
          f"{' (a subset: use --samples 60000 --epochs 1 for the full epoch)' if subset else ''}; "
          f"test accuracy on all 10,000 test images. Timing excludes the first "
          f"{RunConfig.warmup_steps} steps. PyTorch {torch.__version__}. Links: "
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
