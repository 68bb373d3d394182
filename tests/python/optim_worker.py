"""One rank of the terse.optim tests (started by `terse run`); writes OUT/rank-R.json.

Scenarios:
  all       on a small MLP and Fashion-MNIST, with and without DDP: per-step parameter digests and
            bytes of OneBitAdam and ZeroOneAdam; their losses against torch.optim.Adam under DDP;
            a save after N steps, M more steps, and a fresh optimizer loaded from the save
            trained the same M (with the saved engine state, and without it as the control);
            last, rank 1 constructs the optimizer with another lr
  replicas  per-step digests and bytes only (for 4 ranks)
"""

import argparse
import gc
import json
import os
import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import terse
import terse.optim
from fashion_mlp import batch, digest, make_model

LR = 1e-3
# With eps = 1e-8 the compressed momentum of weights whose variance is tiny (those of dead ReLU
# units: about 1e-17) moves them by m / sqrt(v), and this MLP diverges; with 1e-5 0/1 Adam
# diverges on some machines and seeds (docs/python.md).
EPS = 1e-4


# Small schedules, so that a short run crosses every phase: 1-bit Adam freezes after 10 steps;
# 0/1 Adam's variance interval doubles every 4 updates (exact steps 1-4, 6, 8, ..., 12, 16, ...),
# its variance freezes after step 25 and its local-step interval doubles every 4 steps up to 4.
ONEBIT = dict(freeze_step=10)
ZEROONE = dict(var_freeze_step=24, var_update_scaler=4, local_step_scaler=4,
               local_step_clipper=4)


def setup(kind: str, ddp: bool, **knobs):
    module = make_model()
    model = DDP(module, bucket_cap_mb=0.1) if ddp else module
    if kind == "adam":
        return model, torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    # "-deepspeed": the momentum compressed as DeepSpeed does (precondition=False).
    if kind.endswith("-deepspeed"):
        kind, knobs = kind[:-len("-deepspeed")], {**knobs, "precondition": False}
    cls, schedule = ((terse.optim.OneBitAdam, ONEBIT) if kind == "onebit"
                     else (terse.optim.ZeroOneAdam, ZEROONE))
    optimizer = cls(model.parameters(), lr=LR, eps=EPS, model=model, threads=1, timeout=30,
                    **{**schedule, **knobs})
    if ddp:
        model.register_comm_hook(*optimizer.ddp_hook())
    return model, optimizer


def train(model, optimizer, first: int, last: int, record: Optional[Dict] = None) -> List[float]:
    losses = []
    for step in range(first, last):
        x, y = batch(step, dist.get_rank(), dist.get_world_size())
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        before = getattr(optimizer, "bytes_sent", 0)
        optimizer.step()
        losses.append(loss.item())
        if record is not None:
            record["digests"].append(digest(model.parameters()))
            record["synchronized"].append(bool(getattr(optimizer, "synchronized", True)))
            record["bytes"].append(optimizer.bytes_sent - before)
            record["frozen"].append(bool(optimizer.frozen))
    return losses


def replicas(steps: int) -> Dict:
    out = {}
    for kind, ddp in (("onebit", False), ("onebit", True), ("zeroone", False), ("zeroone", True),
                      ("onebit-deepspeed", False), ("zeroone-deepspeed", False)):
        model, optimizer = setup(kind, ddp)
        record: Dict[str, List] = {"digests": [], "synchronized": [], "bytes": [], "frozen": []}
        # Bytes of the DDP hook (warm-up) are counted by the optimizer's engine too: measure the
        # whole step, backward included.
        for step in range(steps):
            before = optimizer.bytes_sent
            train(model, optimizer, step, step + 1, record)
            record["bytes"][-1] = optimizer.bytes_sent - before
        record["parameters"] = sum(p.numel() for p in model.parameters())
        out[f"{kind}{'-ddp' if ddp else ''}"] = record
        optimizer.close()
    return out


def converge(steps: int) -> Dict:
    out = {}
    for kind in ("adam", "onebit", "zeroone", "onebit-deepspeed", "zeroone-deepspeed"):
        knobs = {} if kind == "adam" else (
            dict(freeze_step=30) if kind.startswith("onebit") else
            dict(var_freeze_step=30, var_update_scaler=4, local_step_scaler=20,
                 local_step_clipper=4))
        model, optimizer = setup(kind, True, **knobs)
        losses = train(model, optimizer, 0, steps)
        out[kind] = losses
        if kind != "adam":
            optimizer.close()
    return out


def resume(path: str, before: int, after: int) -> Dict:
    out = {}
    for kind in ("onebit", "zeroone"):
        model, optimizer = setup(kind, True)
        train(model, optimizer, 0, before)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        train(model, optimizer, before, before + after)
        result = {"continued": digest(model.parameters())}
        optimizer.close()
        for with_engine in (True, False):
            checkpoint = torch.load(path)
            model, optimizer = setup(kind, True)
            model.load_state_dict(checkpoint["model"])
            state = checkpoint["optimizer"]
            if not with_engine:
                state = {**state, "engine": optimizer.engine.save_state()}
            optimizer.load_state_dict(state)
            train(model, optimizer, before, before + after)
            result["resumed" if with_engine else "control"] = digest(model.parameters())
            optimizer.close()
        # A checkpoint of another configuration is refused by name.
        model, optimizer = setup(kind, True, **({"freeze_step": 6} if kind == "onebit"
                                                 else {"local_step_clipper": 8}))
        try:
            optimizer.load_state_dict(torch.load(path)["optimizer"])
            result["other"] = "loaded"
        except terse.MismatchError as e:
            result["other"] = str(e)
        optimizer.close()
        out[kind] = result
    return out


def mismatch() -> Dict:
    out = {}
    odd = dist.get_rank() == 1
    for setting, knobs in (("lr", dict(lr=LR * (2 if odd else 1))),
                           ("precondition", dict(precondition=not odd))):
        try:
            optimizer = terse.optim.OneBitAdam(make_model().parameters(), threads=1, timeout=20,
                                               **knobs)
            optimizer.close()
            out[setting] = {"error": None}
        except terse.MismatchError as e:
            out[setting] = {"error": str(e), "type": type(e).__name__}
    return out


def run(args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    result = {"replicas": replicas(args.steps)}
    if args.scenario == "all":
        result["converge"] = converge(args.converge_steps)
        path = os.path.join(args.out, f"checkpoint-{dist.get_rank()}.pt")
        result["resume"] = resume(path, 16, 10)
        result["mismatch"] = mismatch()
    result["rank"] = dist.get_rank()
    with open(os.path.join(args.out, f"rank-{dist.get_rank()}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(args.out, f"rank-{dist.get_rank()}.json.tmp"),
               os.path.join(args.out, f"rank-{dist.get_rank()}.json"))
    gc.collect()
    dist.destroy_process_group()


def parse(argv: List[str]):
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=("all", "replicas"))
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--converge-steps", type=int, default=150)
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse(sys.argv[1:]))
