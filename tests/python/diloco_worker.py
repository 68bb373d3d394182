"""One rank of the terse.diloco tests (started by `terse run`, or alone for "dead"); writes
OUT/rank-R.json.

Scenarios:
  all       on a small MLP and Fashion-MNIST (each rank its own batches): per-step digests of
            the global and the local parameters of DiLoCo and Streaming DiLoCo configurations;
            H = 1 with plain SGD against synchronous data-parallel SGD; losses of DiLoCo against
            synchronous AdamW; 5 synchronous steps first (warmup); a save with an exchange in flight, more steps, and a fresh
            DiLoCo loaded from the save; rank 1 constructs with another H; rank 1's parameters
            turn NaN before an outer step
  replicas  the per-step digests only, and (4 ranks) a worker of each host's 2 ranks: DDP
            inside ranks {0, 1} and {2, 3}, DiLoCo across the ranks of the same local rank
  dead      rank 1 exits before the first outer step; rank 0 records the error it gets
"""

import argparse
import gc
import json
import os
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

import terse
import terse.diloco
from fashion_mlp import batch, digest, make_model



# Configurations every world size runs: (name, DiLoCo's knobs).
CONFIGS = {
    "diloco": dict(sync_every=4),
    "diloco-minmax4": dict(sync_every=4, codec="minmax8:bits=4,ef=1"),
    "streaming": dict(sync_every=6, fragments=3, delay=1, mixing=0.5,
                      codec="minmax8:bits=4,ef=1"),
    "streaming-raw": dict(sync_every=4, fragments=2),
}


def setup(lr: float = 1e-3, **knobs):
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, terse.diloco.DiLoCo(model, inner, threads=1, timeout=30, **knobs)


def train(model, optimizer, first: int, last: int, record: Dict[str, List] = None) -> List[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(first, last):
        x, y = batch(step, rank, world)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if record is not None:
            record["global"].append(digest(optimizer.global_parameters().values()))
            record["local"].append(digest(model.parameters()))
            record["outer_steps"].append(optimizer.outer_steps)
    return losses


def replicas(steps: int) -> Dict:
    out = {}
    for name, knobs in CONFIGS.items():
        model, optimizer = setup(**knobs)
        record: Dict[str, Any] = {"global": [], "local": [], "outer_steps": []}
        train(model, optimizer, 0, steps, record)
        optimizer.finish()
        record["final_global"] = digest(optimizer.global_parameters().values())
        record["stats"] = optimizer.stats()
        record["offsets"] = optimizer.offsets
        record["fragments"] = [f.names for f in optimizer.fragments]
        out[name] = record
        optimizer.close()
    return out


def hosts(steps: int) -> Dict:
    """4 ranks as 2 hosts of 2: each host trains one replica with DDP over its own ranks, and
    DiLoCo averages across hosts over the group of the ranks of the same local rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    host_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes each
    cross_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    host, local = divmod(rank, 2)
    model = make_model()
    ddp = DDP(model, process_group=host_groups[host])
    optimizer = terse.diloco.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                    sync_every=4, codec="minmax8:bits=4,ef=1", threads=1,
                                    timeout=30, process_group=cross_groups[local])
    record: Dict[str, Any] = {"global": [], "local": [], "outer_steps": []}
    for step in range(steps):
        x, y = batch(step, rank, world)  # each rank its own batch: DDP averages the host's two
        optimizer.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        record["global"].append(digest(optimizer.global_parameters().values()))
        record["local"].append(digest(model.parameters()))
        record["outer_steps"].append(optimizer.outer_steps)
    optimizer.finish()
    record["final_global"] = digest(optimizer.global_parameters().values())
    record["final_local"] = digest(model.parameters())
    record["workers"] = optimizer.engine.size
    optimizer.close()
    del ddp
    return record


def synchronous_sgd(steps: int) -> Dict:
    """H = 1, inner SGD lr 0.1 without momentum, outer SGD lr 1 without momentum: DiLoCo is then
    synchronous SGD on averaged gradients (up to the rounding of global - (global - lr g))."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    optimizer = terse.diloco.DiLoCo(
        model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=1, threads=1, timeout=30,
        outer_optimizer=lambda params: torch.optim.SGD(params, lr=1.0))
    train(model, optimizer, 0, steps)
    optimizer.close()
    reference = make_model()
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        sgd.zero_grad()
        for r in range(world):  # the average of every rank's gradient, computed here alone
            x, y = batch(step, r, world)
            (F.cross_entropy(reference(x), y) / world).backward()
        sgd.step()
    gap = max((a - b).abs().max().item()
              for a, b in zip(model.parameters(), reference.parameters()))
    scale = max(p.abs().max().item() for p in reference.parameters())
    return {"max_difference": gap, "scale": scale, "rank": rank}


def warmup(steps: int, warm: int = 5) -> Dict:
    """The first ``warm`` steps synchronous (exact gradient averages) at H 4: per-step digests,
    and the parameters after the warm-up against AdamW on every rank's gradients averaged
    here."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = setup(sync_every=4, warmup=warm)
    record: Dict[str, Any] = {"global": [], "local": [], "outer_steps": []}
    train(model, optimizer, 0, warm, record)
    warmed = [p.detach().clone() for p in model.parameters()]
    train(model, optimizer, warm, steps, record)
    optimizer.finish()
    record["stats"] = optimizer.stats()
    optimizer.close()
    reference = make_model()
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(warm):
        adamw.zero_grad()
        for r in range(world):
            x, y = batch(step, r, world)
            (F.cross_entropy(reference(x), y) / world).backward()
        adamw.step()
    record["max_difference"] = max((a - b).abs().max().item()
                                   for a, b in zip(warmed, reference.parameters()))
    return record


def converge(steps: int) -> Dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: Dict[str, List[float]] = {}
    # Synchronous AdamW on the global batch: every rank computes the average gradient alone.
    model = make_model()
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        adam.zero_grad()
        total = 0.0
        for r in range(world):
            x, y = batch(step, r, world)
            loss = F.cross_entropy(model(x), y) / world
            loss.backward()
            total += loss.item()
        adam.step()
        losses.append(total)
    out["adamw"] = losses
    for name, knobs in (("diloco", dict(sync_every=10)),
                        ("diloco-minmax4", dict(sync_every=10, codec="minmax8:bits=4,ef=1"))):
        model, optimizer = setup(**knobs)
        out[name] = train(model, optimizer, 0, steps)
        optimizer.finish()
        # The global model's loss on the same last batches as AdamW's.
        module = optimizer.global_model()
        with torch.no_grad():
            out[name + "-global"] = [sum(F.cross_entropy(module(batch(s, r, world)[0]),
                                                         batch(s, r, world)[1]).item()
                                         for r in range(world)) / world
                                     for s in range(steps - 20, steps)]
        optimizer.close()
    return out


def resume(path: str, before: int, after: int) -> Dict:
    knobs = CONFIGS["streaming"]
    model, optimizer = setup(**knobs)
    # `before` is a step that starts an exchange (H 6, 3 fragments: offsets 2, 4, 0), which
    # delay 1 keeps in flight across the save.
    train(model, optimizer, 0, before)
    in_flight = [f.index for f in optimizer.fragments if f.handle is not None]
    torch.save({"model": model.state_dict(), "diloco": optimizer.state_dict()}, path)
    train(model, optimizer, before, before + after)
    optimizer.finish()
    result: Dict[str, Any] = {"continued": digest(model.parameters()),
                              "continued_global": digest(optimizer.global_parameters().values()),
                              "in_flight": in_flight}
    # The same DiLoCo, past the save and finished, loaded back: it repeats the same steps.
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["diloco"])
    train(model, optimizer, before, before + after)
    optimizer.finish()
    result["rewound"] = digest(model.parameters())
    optimizer.close()
    for with_state in (True, False):
        checkpoint = torch.load(path)
        model, optimizer = setup(**knobs)
        model.load_state_dict(checkpoint["model"])
        if with_state:
            optimizer.load_state_dict(checkpoint["diloco"])
        train(model, optimizer, before, before + after)
        optimizer.finish()
        result["resumed" if with_state else "control"] = digest(model.parameters())
        if with_state:
            result["resumed_global"] = digest(optimizer.global_parameters().values())
        optimizer.close()
    model, optimizer = setup(**{**knobs, "sync_every": 8})
    try:
        optimizer.load_state_dict(torch.load(path)["diloco"])
        result["other"] = "loaded"
    except terse.MismatchError as e:
        result["other"] = str(e)
    optimizer.close()
    return result


def mismatch() -> Dict:
    h = 5 if dist.get_rank() == 1 else 4
    try:
        _, optimizer = setup(sync_every=h)
        optimizer.close()
        return {"error": None}
    except terse.MismatchError as e:
        return {"error": str(e), "type": type(e).__name__}


def nonfinite() -> Dict:
    model, optimizer = setup(sync_every=4, codec="minmax8:bits=4,ef=1")
    train(model, optimizer, 0, 3)
    if dist.get_rank() == 1:
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
    try:
        train(model, optimizer, 3, 4)
        result = {"error": None}
    except terse.Error as e:
        result = {"error": str(e), "type": type(e).__name__}
    result["global_finite"] = all(bool(torch.isfinite(g).all())
                                  for g in optimizer.global_parameters().values())
    optimizer.close()
    return result


def nonfinite_warmup() -> Dict:
    """Rank 1's gradient turns NaN at the third of 5 warm-up steps (8-bit averages)."""
    model, optimizer = setup(sync_every=4, warmup=5, warmup_codec="minmax8:ef=1")
    train(model, optimizer, 0, 2)
    if dist.get_rank() == 1:
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
    before = digest(model.parameters())
    try:
        train(model, optimizer, 2, 3)
        result = {"error": None}
    except terse.Error as e:
        result = {"error": str(e), "type": type(e).__name__}
    result["unchanged"] = digest(model.parameters()) == before
    optimizer.close()
    return result


def dead(out: str) -> None:
    rank = int(os.environ["RANK"])
    model = make_model()
    optimizer = terse.diloco.DiLoCo(model, torch.optim.AdamW(model.parameters()), sync_every=3,
                                    threads=1, timeout=5,
                                    communicator=terse.Communicator.from_env(timeout=5))
    world = optimizer.engine.size
    if rank == 1:
        os._exit(0)  # gone before the first outer step
    start = time.perf_counter()
    try:
        for step in range(3):
            x, y = batch(step, rank, world)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        result = {"error": None}
    except terse.Error as e:
        result = {"error": str(e), "type": type(e).__name__}
    result["seconds"] = time.perf_counter() - start
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def run(args) -> None:
    torch.set_num_threads(1)
    if args.scenario == "dead":
        dead(args.out)
        return
    dist.init_process_group("gloo", init_method="env://")
    result: Dict[str, Any] = {"replicas": replicas(args.steps)}
    if args.scenario == "replicas" and dist.get_world_size() == 4:
        result["hosts"] = hosts(args.steps)
    if args.scenario == "all":
        result["synchronous_sgd"] = synchronous_sgd(12)
        result["warmup"] = warmup(args.steps)
        result["converge"] = converge(args.converge_steps)
        path = os.path.join(args.out, f"checkpoint-{dist.get_rank()}.pt")
        result["resume"] = resume(path, 14, 9)
        result["mismatch"] = mismatch()
        result["nonfinite"] = nonfinite()
        result["nonfinite_warmup"] = nonfinite_warmup()
    result["rank"] = dist.get_rank()
    tmp = os.path.join(args.out, f"rank-{dist.get_rank()}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(args.out, f"rank-{dist.get_rank()}.json"))
    gc.collect()
    dist.destroy_process_group()


def parse(argv: List[str]):
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=("all", "replicas", "dead"))
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=26)
    p.add_argument("--converge-steps", type=int, default=150)
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse(sys.argv[1:]))
