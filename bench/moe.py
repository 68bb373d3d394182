#!/usr/bin/env python3
"""The mixture-of-experts benchmark: a model with one MoE layer (terse.moe) trained on
Fashion-MNIST with its dispatch and combine all-to-alls exact (torch.distributed over Gloo) and
through terse with lossy codecs, 4 emulated hosts, same seeds and batches.

    bench/moe.py run --link 100mbit [--exchanges torch,fp16,minmax8] [--epochs 1]
    bench/moe.py worker --exchange minmax8 --out F.json ...    # one rank (run by `run`)

Reported per exchange: final test accuracy, the median time of a step's four all-to-alls
(dispatch and combine, forward and backward) and of the whole step, the bytes each rank sent
on its interface per step, and whether the replicated parameters stayed identical. Model: a
784-W linear layer, a residual MoE layer (width W, 8 experts of hidden size 4W, two per rank,
top-1, capacity factor 1.25), a W-10 head; SGD lr 0.05, momentum 0.9, B images a rank a step
(--width W, default 256; --batch B, default 64).
"""

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    import terse.moe
    from terse_harness.data import load_fashion_mnist
    from terse_harness.training import interface_tx_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    exchange = (terse.moe.TorchExchange() if args.exchange == "torch"
                else terse.moe.TerseExchange(codec=args.exchange, timeout=args.timeout))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)  # the replicated layers: the same on every rank
            self.inp = nn.Linear(784, args.width)
            self.moe = terse.moe.MoE(args.width, 4 * args.width, 2, exchange)
            self.norm = nn.LayerNorm(args.width)
            self.head = nn.Linear(args.width, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.relu(self.inp(x))
            h = h + self.moe(h)
            return self.head(self.norm(h))

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = load_fashion_mnist("train", limit=args.samples)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    xt, yt = load_fashion_mnist("test")
    xt, yt = torch.from_numpy(xt), torch.from_numpy(yt)
    batch = args.batch
    steps_per_epoch = len(x) // (batch * world)
    ifname = os.environ.get("TERSE_IFNAME")
    step_times: List[float] = []
    exchange_times: List[float] = []
    wire0 = interface_tx_bytes(ifname)
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(steps_per_epoch):
            index = order[i * batch * world + rank * batch:][:batch]
            before = exchange.seconds
            t0 = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[index]), y[index]) + 0.01 * model.moe.aux_loss
            loss.backward()
            terse.moe.average_replicated_gradients(model)
            optimizer.step()
            step_times.append(time.perf_counter() - t0)
            exchange_times.append(exchange.seconds - before)
            if rank == 0 and (i + 1) % max(1, steps_per_epoch // 5) == 0:
                print(f"[{args.exchange}] epoch {epoch} step {i + 1}/{steps_per_epoch} "
                      f"loss {loss.item():.3f}", flush=True)
    wire1 = interface_tx_bytes(ifname)
    # Test accuracy: every rank scores its share of the test set (the MoE layer needs all).
    model.eval()
    correct = 0
    share = torch.arange(rank, len(xt), world)
    with torch.no_grad():
        for chunk in share.split(500):
            correct += int((model(xt[chunk]).argmax(1) == yt[chunk]).sum())
    counts = torch.tensor([float(correct), float(len(share))], dtype=torch.float64)
    dist.all_reduce(counts)
    digest = hashlib.sha256()
    expert_ids = {id(p) for p in model.moe.expert_parameters()}
    for p in model.parameters():
        if id(p) not in expert_ids:
            digest.update(p.detach().numpy().tobytes())
    mine = {"digest": digest.hexdigest(),
            "wire": (wire1 - wire0) / len(step_times) if wire0 is not None else None}
    everyone: List[Optional[Dict[str, Any]]] = [None] * world
    dist.all_gather_object(everyone, mine)
    exchange.close()
    if rank == 0:
        skip = min(5, len(step_times) - 1)  # warm-up: first uses, the engine's checks

        def median(v: List[float]) -> float:
            v = sorted(v[skip:])
            return v[len(v) // 2]

        wires = [r["wire"] for r in everyone]
        result = {
            "exchange": args.exchange, "link": os.environ.get("TERSE_LINK", ""), "ranks": world,
            "epochs": args.epochs, "samples": len(x), "steps": len(step_times),
            "test_accuracy": float(counts[0] / counts[1]),
            "median_step_seconds": median(step_times),
            "median_exchange_seconds": median(exchange_times),
            "wire_bytes_per_step": (sum(wires) / len(wires)
                                    if all(w is not None for w in wires) else None),
            "replicas_identical": len({r["digest"] for r in everyone}) == 1,
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    sys.path[:0] = [os.path.join(ROOT, "build", "python"), HERE]  # the build's terse, the harness
    from terse_harness import launch

    os.makedirs(args.results, exist_ok=True)
    results = []
    for exchange in args.exchanges.split(","):
        out = os.path.abspath(os.path.join(
            args.results, f"{args.link}-w{args.width}-b{args.batch}-{exchange}.json"))
        rank = ["env", f"TERSE_LINK={args.link}", sys.executable, os.path.abspath(__file__),
                "worker", "--exchange", exchange, "--epochs", str(args.epochs), "--samples",
                str(args.samples), "--width", str(args.width), "--batch", str(args.batch),
                "--out", out]
        print(f"== {exchange} over {args.link}", flush=True)
        status, _, _ = launch.run(rank, args.ranks, args.link, 60.0,  # TERSE_TIMEOUT's default
                                  on_line=lambda line, _: print(line, end="", flush=True))
        if status != 0:
            raise SystemExit(f"bench/moe.py: {exchange} over {args.link}: exit status {status}")
        with open(out) as f:
            results.append(json.load(f))
    base = next((r for r in results if r["exchange"] == "torch"), None)
    print(f"\n| exchange | test accuracy | all-to-alls a step (ms) | x torch | step (ms) | "
          f"bytes sent a step | replicas identical |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        ratio = (base["median_exchange_seconds"] / r["median_exchange_seconds"]
                 if base else float("nan"))
        wire = f"{r['wire_bytes_per_step']:,.0f}" if r["wire_bytes_per_step"] else "-"
        print(f"| {r['exchange']} | {100 * r['test_accuracy']:.2f}% | "
              f"{1e3 * r['median_exchange_seconds']:.2f} | {ratio:.2f}x | "
              f"{1e3 * r['median_step_seconds']:.2f} | {wire} | {r['replicas_identical']} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="every exchange over emulated hosts (root)")
    r.add_argument("--link", default="100mbit")
    r.add_argument("--ranks", type=int, default=4)
    r.add_argument("--exchanges", default="torch,fp16,minmax8")
    r.add_argument("--epochs", type=int, default=1)
    r.add_argument("--samples", type=int, default=60000)
    r.add_argument("--results", default=os.path.join(ROOT, "results", "moe"))
    w = sub.add_parser("worker", help="one rank")
    for q in (r, w):
        q.add_argument("--width", type=int, default=256, help="model width (experts: 4x)")
        q.add_argument("--batch", type=int, default=64, help="images (tokens) a rank a step")
    w.add_argument("--exchange", required=True, help="torch, or a terse codec spec")
    w.add_argument("--epochs", type=int, default=1)
    w.add_argument("--samples", type=int, default=60000)
    w.add_argument("--timeout", type=float, default=120.0)
    w.add_argument("--out", required=True)
    args = p.parse_args()
    (run if args.command == "run" else worker)(args)


if __name__ == "__main__":
    main()
