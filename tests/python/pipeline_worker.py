"""One stage of the pipeline tests (tests/python/test_pipeline.py), started as a rank with
torchrun's environment by `terse run` or as a plain subprocess.

Modes (argv[1]):
  train COMPRESSOR...  trains a small MLP on Fashion-MNIST images for --steps steps per
                       compressor and writes this stage's parameters, losses, bytes sent and
                       the delta caches' digests to --out/rank-R.json
  reference            trains the same model in this one process, without a pipeline, with
                       the same micro-batches (--micro-batches, backward order of --schedule)
                       and writes its parameters
  dead                 trains until --at-step, where stage --victim kills itself (SIGKILL)
                       or stops (SIGSTOP); the others record the error they get
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch
from torch import nn

import terse
import terse.torch
from terse_harness.data import load_fashion_mnist

BATCH = 32


def make_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, 10))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def train(args: argparse.Namespace, compressor: str, x, y) -> dict:
    model = make_model(args.width)
    options = dict(micro_batches=args.micro_batches, schedule=args.schedule)
    if compressor.startswith("ae") or compressor.startswith("delta"):
        options.update(forward=compressor, backward=args.backward)
    else:
        options.update(forward=compressor, backward=compressor if args.backward == "same"
                       else args.backward)
    options["warmup_steps"] = args.warmup
    options["uncompressed_boundaries"] = args.uncompressed
    options["replicas"] = args.replicas
    pipe = terse.torch.pipeline(model, **options)
    pipe.setup(x[:2])
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    order = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        # A small pool of samples revisited in random order, so that delta compression sees
        # samples again after the first pass.
        # Replicas of a stage take different samples of the same permutation.
        first = pipe.replica * BATCH
        index = torch.randperm(len(x), generator=order)[first:first + BATCH]
        optimizer.zero_grad()
        loss = pipe.step(x[index], y[index], indices=index)
        optimizer.step()
        if loss is not None:
            losses.append(loss)
    prediction = pipe.predict(x[:256])
    result = {
        "stage": pipe.stage, "replica": pipe.replica,
        "parameters": {name: p.detach().flatten().tolist() if args.dump else digest(p)
                       for name, p in pipe.named_parameters()},
        "losses": losses,
        "bytes_sent": pipe.bytes_sent,
        "accuracy": (float((prediction.argmax(1) == y[:256]).float().mean())
                     if prediction is not None else None),
        "caches": {side: digest(b.cache) for side, b in
                   (("in", pipe.in_boundary), ("out", pipe.out_boundary))
                   if b is not None and b.cache is not None},
        "profile": pipe.profile(),
    }
    pipe.close()
    return result


def reference(args: argparse.Namespace, x, y) -> dict:
    """Single-process training of the same model on the same batches: per step, micro-batch
    losses weighted by their share of the batch, backward in the schedule's order. It runs in
    a rank of its own because the BLAS's thread count (from the environment at import) changes
    the last bits of matrix products."""
    model = make_model(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    order = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        index = torch.randperm(len(x), generator=order)[:BATCH]
        xb, yb = x[index], y[index]
        optimizer.zero_grad()
        chunks = list(zip(xb.tensor_split(args.micro_batches),
                          yb.tensor_split(args.micro_batches)))
        backward_order = (reversed(range(len(chunks))) if args.schedule == "gpipe"
                          else range(len(chunks)))
        for m in backward_order:
            xm, ym = chunks[m]
            loss = nn.functional.cross_entropy(model(xm), ym) * (len(xm) / len(xb))
            loss.backward()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "reference", "dead"])
    p.add_argument("compressors", nargs="*", default=["none"])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--schedule", default="gpipe")
    p.add_argument("--backward", default="same")
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--uncompressed", type=int, default=0, help="uncompressed first boundaries")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas per stage")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dump", action="store_true", help="write parameter values, not digests")
    p.add_argument("--victim", type=int, default=2)
    p.add_argument("--at-step", type=int, default=3)
    p.add_argument("--how", choices=["kill", "stall"], default="kill")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    x_np, y_np = load_fashion_mnist("train", limit=args.samples)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    out = {"rank": rank}
    if args.mode == "train":
        for compressor in args.compressors:
            out[compressor] = train(args, compressor, x, y)
    elif args.mode == "reference":
        out["parameters"] = {name: p.flatten().tolist()
                             for name, p in reference(args, x, y).items()}
    else:
        pipe = terse.torch.pipeline(make_model(args.width), micro_batches=args.micro_batches)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr)
        started = None
        try:
            for step in range(1000):
                if step == args.at_step:
                    started = time.monotonic()
                    if pipe.stage == args.victim:
                        os.kill(os.getpid(),
                                signal.SIGKILL if args.how == "kill" else signal.SIGSTOP)
                optimizer.zero_grad()
                pipe.step(x[:BATCH], y[:BATCH])
                optimizer.step()
            out["failed"] = False
        except terse.Error as e:
            out.update(failed=True, error=str(e), error_type=type(e).__name__,
                       seconds_to_fail=time.monotonic() - started if started else None,
                       timeout=terse.default_timeout())
        with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
            json.dump(out, f)
        # A failed communicator's peers are gone: leave without waiting for anything.
        sys.stdout.flush()
        os._exit(3 if out.get("failed") else 0)
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
