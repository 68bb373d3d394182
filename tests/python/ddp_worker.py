"""One rank of the multi-process DDP tests (started by `terse run`, by subprocesses with
torchrun's environment, or by torch.multiprocessing.spawn). Each rank writes OUT/rank-R.json.

Scenarios:
  train CODEC... [--subgroups] [--dtype bfloat16|float16] [--autocast]
                        trains a DDP model with DDP's own allreduce, then one per codec with the
                        terse hook, from the same initial weights on the same data; records a
                        digest of the parameters, the losses, the bytes sent and the largest
                        difference from DDP's own result. --subgroups: then trains over process
                        groups {0, 1} and {2, 3}. --dtype: the model cast to it (DDP's buckets
                        and the hook's tensors too); --autocast: fp32 model, forward under CPU
                        autocast to bfloat16 (fp32 master weights and gradients)
  resume save|load CODEC...
                        save: trains K steps, checkpoints model, optimizer and hook state, trains
                        M more; load: restores the checkpoint in fresh processes and trains the
                        same M steps, once with the hook state and once without (the control)
  kill|stall --victim R --at-step S
                        rank R SIGKILLs (kill) or SIGSTOPs (stall) itself before backward of step
                        S; the others record how their training failed and exit 3. The timeout
                        comes from TERSE_TIMEOUT.
  mismatch              rank 1 asks for another codec than the others
"""

import argparse
import gc
import hashlib
import json
import os
import signal
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import terse
import terse.torch
from terse.data import load_fashion_mnist

BATCH = 32
SAMPLES = 2048
LR = 0.05
# Gradients of at least this many bytes are compressed: both hidden-layer weights (401 KiB and
# 32 KiB); biases and the output layer (2.5 KiB) travel raw and fused.
MIN_BYTES = 16 << 10
# Small buckets, so that a step has several and DDP's rebuild after step 0 changes them.
BUCKET_CAP_MB = 0.1

_data = None


def data():
    global _data
    if _data is None:
        x, y = load_fashion_mnist("test", limit=SAMPLES)  # the smaller file: quick to read
        _data = torch.from_numpy(x), torch.from_numpy(y)
    return _data


# The model's dtype and whether its forward runs under CPU autocast (set from the arguments).
DTYPE = torch.float32
AUTOCAST = False


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(784, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10)).to(DTYPE)


def batch(step: int):
    """This rank's batch of global step `step`: the same on every run."""
    x, y = data()
    rank, world = dist.get_rank(), dist.get_world_size()
    start = ((step * world + rank) * BATCH) % (SAMPLES - BATCH)
    return x[start:start + BATCH], y[start:start + BATCH]


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().numpy().tobytes())  # exact for bf16 and fp16
    return h.hexdigest()


def train(model: DDP, optimizer, first: int, last: int) -> List[float]:
    losses = []
    for step in range(first, last):
        x, y = batch(step)
        optimizer.zero_grad()
        if AUTOCAST:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
        else:
            loss = F.cross_entropy(model(x.to(DTYPE)), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def setup(codec: Optional[str], timeout: Optional[float] = 20, **knobs):
    """A fresh DDP model and optimizer; with codec, the terse hook registered on it."""
    model = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    state = None
    if codec is not None:
        state, hook = terse.torch.ddp_hook(model, codec=codec, min_bytes=MIN_BYTES, threads=2,
                                           timeout=timeout, **knobs)
        model.register_comm_hook(state, hook)
    return model, optimizer, state


def scenario_train(args) -> Dict:
    steps = args.steps
    reference, optimizer, _ = setup(None)
    ref_losses = train(reference, optimizer, 0, steps)
    ref_params = [p.detach().clone() for p in reference.parameters()]
    out = {"ddp": {"digest": digest(reference), "losses": ref_losses}}
    for codec in args.codecs:
        model, optimizer, state = setup(codec)
        start = time.perf_counter()
        losses = train(model, optimizer, 0, steps)
        seconds = time.perf_counter() - start
        diff = max((p.detach().float() - r.float()).abs().max().item()
                   for p, r in zip(model.parameters(), ref_params))
        out[codec] = {
            "digest": digest(model),
            "losses": losses,
            "max_abs_diff_from_ddp": diff,
            "bytes_sent": state.bytes_sent,
            "buckets": state.steps,
            "seconds": seconds,
            "plan": [(name, n, plan.codec, plan.strategy) for name, n, plan in state.plan()],
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        state.close()
    if args.subgroups:
        # Two DDP jobs side by side: ranks {0, 1} and {2, 3}, each with its own process group
        # and its own terse communicator (bootstrapped through the shared default store).
        world = dist.get_world_size()
        groups = [dist.new_group(list(range(g, g + 2))) for g in range(0, world, 2)]
        group = groups[dist.get_rank() // 2]
        model = DDP(make_model(), process_group=group, bucket_cap_mb=BUCKET_CAP_MB)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        state, hook = terse.torch.ddp_hook(model, codec="fp16", min_bytes=MIN_BYTES, threads=2,
                                           timeout=20, process_group=group)
        model.register_comm_hook(state, hook)
        train(model, optimizer, 0, steps)
        out["subgroup"] = {"digest": digest(model), "size": state.engine.size,
                           "rank": state.engine.rank}
        state.close()
    return out


def scenario_resume(args) -> Dict:
    phase, codecs = args.codecs[0], args.codecs[1:]
    before, after = args.steps, args.steps
    rank = dist.get_rank()
    out = {}
    for codec in codecs:
        path = os.path.join(args.checkpoint, f"{codec.replace(':', '_')}-rank{rank}.pt")
        if phase == "save":
            model, optimizer, state = setup(codec)
            train(model, optimizer, 0, before)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "terse": state.state_dict(), "step": before}, path)
            train(model, optimizer, before, before + after)
            out[codec] = {"continued": digest(model)}
            state.close()
        else:
            result = {}
            for with_state in (True, False):
                checkpoint = torch.load(path)
                model, optimizer, state = setup(codec)
                model.load_state_dict(checkpoint["model"])
                optimizer.load_state_dict(checkpoint["optimizer"])
                if with_state:
                    state.load_state_dict(checkpoint["terse"])
                step = checkpoint["step"]
                train(model, optimizer, step, step + after)
                result["resumed" if with_state else "resumed_without_hook_state"] = digest(model)
                state.close()
            out[codec] = result
    return out


def scenario_kill(args) -> Dict:
    victim, when = args.victim, args.at_step
    model, optimizer, state = setup("onebit:ef=1", timeout=None)  # TERSE_TIMEOUT
    rank = dist.get_rank()
    how = signal.SIGKILL if args.scenario == "kill" else signal.SIGSTOP
    failed_at = None
    try:
        for step in range(when + 50):
            x, y = batch(step)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if step == when and rank == victim:
                os.kill(os.getpid(), how)
            if step == when:
                failed_at = time.monotonic()
            loss.backward()
            optimizer.step()
    except Exception as e:  # what DDP raises: RuntimeError carrying the hook's error text
        return {"failed": True, "raised": type(e).__name__, "message": str(e),
                "error_type": type(state.error).__name__ if state.error else None,
                "error": str(state.error) if state.error else None,
                "seconds_to_fail": time.monotonic() - failed_at if failed_at else None,
                "timeout": terse.default_timeout()}
    return {"failed": False}


def scenario_mismatch(args) -> Dict:
    codec = "fp16" if dist.get_rank() == 1 else "onebit:ef=1"
    model, optimizer, state = setup(codec)
    try:
        train(model, optimizer, 0, 2)
    except Exception as e:
        return {"failed": True, "raised": type(e).__name__, "message": str(e),
                "error_type": type(state.error).__name__ if state.error else None,
                "is_mismatch": isinstance(state.error, terse.MismatchError),
                "error": str(state.error)}
    return {"failed": False}


SCENARIOS = {"train": scenario_train, "resume": scenario_resume, "kill": scenario_kill,
             "stall": scenario_kill, "mismatch": scenario_mismatch}


def run(args, init_method: str = "env://", rank: Optional[int] = None,
        world: Optional[int] = None) -> None:
    global DTYPE, AUTOCAST
    DTYPE = getattr(torch, args.dtype)
    AUTOCAST = args.autocast
    torch.set_num_threads(1)
    kwargs = {} if rank is None else {"rank": rank, "world_size": world}
    dist.init_process_group("gloo", init_method=init_method, **kwargs)
    result = SCENARIOS[args.scenario](args)
    result["rank"] = dist.get_rank()
    result["world"] = dist.get_world_size()
    path = os.path.join(args.out, f"rank-{dist.get_rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    if result.get("failed"):
        # The process group may still wait for the dead peer at teardown: leave at once.
        sys.stdout.flush()
        os._exit(3 if args.scenario in ("kill", "stall") else 0)
    # Models (and with them DDP's reducers, which hold the process group) must be gone before
    # the group: see the note in terse/demo.py.
    gc.collect()
    dist.destroy_process_group()


def spawned(rank: int, world: int, init_method: str, argv: List[str]) -> None:
    """Entry point for torch.multiprocessing.spawn."""
    run(parse(argv), init_method=init_method, rank=rank, world=world)


def parse(argv: List[str]):
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("codecs", nargs="*")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--checkpoint", default="")
    p.add_argument("--subgroups", action="store_true",
                   help="train: also two DDP jobs over process groups of 2 ranks each")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--autocast", action="store_true")
    p.add_argument("--victim", type=int, default=-1)
    p.add_argument("--at-step", type=int, default=3)
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse(sys.argv[1:]))
