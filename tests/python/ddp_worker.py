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
  features              DDP's options with the hook: no_sync() accumulation, static_graph,
                        gradient_as_bucket_view, uneven inputs under Join; each trained with
                        DDP's allreduce, the hook with codec none, and the hook with powersgd
  warmup                powersgd with warmup_steps against codec none and plain DDP
  compile               torch.compile'd DDP models with the hook in each optimize_ddp mode
                        (torch 2.x)
  disagree names|shapes ranks build models that differ in parameter names or shapes
  sparse                a sparse embedding under DDP with the hook

A codec argument may carry hook knobs: "powersgd/warmup_steps=6".
"""

import argparse
import collections
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
from terse_harness.data import load_fashion_mnist

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


def make_model(hidden: int = 128) -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(784, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 64), torch.nn.ReLU(),
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
            "buckets": state.buckets,
            "steps": state.steps,
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


def parse_codec(token: str):
    """"powersgd/warmup_steps=6" -> ("powersgd", {"warmup_steps": 6})."""
    codec, *knobs = token.split("/")
    return codec, {k: int(v) for k, v in (knob.split("=") for knob in knobs)}


def scenario_resume(args) -> Dict:
    phase, codecs = args.codecs[0], args.codecs[1:]
    before, after = args.steps, args.steps
    rank = dist.get_rank()
    out = {}
    for token in codecs:
        codec, knobs = parse_codec(token)
        path = os.path.join(args.checkpoint,
                            f"{token.replace(':', '_').replace('/', '_')}-rank{rank}.pt")
        if phase == "save":
            model, optimizer, state = setup(codec, **knobs)
            train(model, optimizer, 0, before)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "terse": state.state_dict(), "step": before}, path)
            train(model, optimizer, before, before + after)
            out[token] = {"continued": digest(model), "steps": state.steps}
            state.close()
        else:
            result = {}
            for with_state in (True, False):
                checkpoint = torch.load(path)
                model, optimizer, state = setup(codec, **knobs)
                model.load_state_dict(checkpoint["model"])
                optimizer.load_state_dict(checkpoint["optimizer"])
                if with_state:
                    state.load_state_dict(checkpoint["terse"])
                step = checkpoint["step"]
                train(model, optimizer, step, step + after)
                result["resumed" if with_state else "resumed_without_hook_state"] = digest(model)
                if with_state:
                    result["steps"] = state.steps
                state.close()
            out[token] = result
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

class Pair(torch.nn.Module):
    """Runs a network on two batches in one forward: one backward then accumulates both
    batches' gradients into each parameter as no_sync() accumulation does (g1 + g2)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x1, x2):
        return self.net(x1), self.net(x2)


def train_mode(mode: str, codec: Optional[str], steps: int) -> Dict:
    """Trains plain DDP (codec None) or the hook under one of DDP's options; returns the digest,
    losses and the hook's counters."""
    from torch.distributed.algorithms.join import Join
    kwargs = {"static_graph": True} if mode == "static_graph" else (
        {"gradient_as_bucket_view": True} if mode == "bucket_view" else {})
    # A first weight of 1.6 MB: DDP's first bucket holds at most 1 MiB, so a step has two.
    net = make_model(hidden=512)
    model = DDP(Pair(net) if mode == "pair" else net, bucket_cap_mb=BUCKET_CAP_MB, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    state = None
    if codec is not None:
        # Named after the network, so that "pair" and "no_sync" plan and seed alike.
        state, hook = terse.torch.ddp_hook(net, codec=codec, min_bytes=MIN_BYTES, threads=2,
                                           timeout=20)
        model.register_comm_hook(state, hook)
    losses = []
    rank = dist.get_rank()
    if mode == "join":
        # Uneven inputs: rank r has steps + 2 r batches; ranks that run out shadow the others.
        with Join([model]):
            for step in range(steps + 2 * rank):
                x, y = batch(step)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
    else:
        for step in range(steps):
            optimizer.zero_grad()
            if mode == "no_sync":  # two micro-batches, gradients communicated once
                (x1, y1), (x2, y2) = batch(2 * step), batch(2 * step + 1)
                with model.no_sync():
                    loss = F.cross_entropy(model(x1), y1)
                    loss.backward()
                F.cross_entropy(model(x2), y2).backward()
            elif mode == "pair":  # the same two micro-batches in one backward
                (x1, y1), (x2, y2) = batch(2 * step), batch(2 * step + 1)
                o1, o2 = model(x1, x2)
                loss = F.cross_entropy(o1, y1)
                (loss + F.cross_entropy(o2, y2)).backward()
            else:
                x, y = batch(step)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
            optimizer.step()
            losses.append(loss.item())
    out = {"digest": digest(net), "losses": losses}
    if state is not None:
        out.update(steps=state.steps, buckets=state.buckets, error=repr(state.error))
        state.close()
    return out


def scenario_features(args) -> Dict:
    out = {}
    for mode in ("no_sync", "static_graph", "bucket_view", "join"):
        out[mode] = {"ddp": train_mode(mode, None, args.steps),
                     "none": train_mode(mode, "none", args.steps),
                     "powersgd": train_mode(mode, "powersgd", args.steps)}
    out["pair"] = {"onebit:ef=1": train_mode("pair", "onebit:ef=1", args.steps)}
    out["no_sync"]["onebit:ef=1"] = train_mode("no_sync", "onebit:ef=1", args.steps)
    return out


def scenario_warmup(args) -> Dict:
    warmup = args.steps // 2
    out = {}
    for name, codec, knobs in (("ddp", None, {}), ("none", "none", {}),
                               ("warmup", "powersgd", {"warmup_steps": warmup}),
                               ("powersgd", "powersgd", {})):
        model, optimizer, state = setup(codec, **knobs)
        result = {"digests": [], "bytes": []}
        for step in range(args.steps):
            result.setdefault("losses", []).extend(train(model, optimizer, step, step + 1))
            result["digests"].append(digest(model))
            if state is not None:
                result["bytes"].append(state.bytes_sent)
        if state is not None:
            result["steps"] = state.steps
            result["plan"] = [(n, p.codec) for n, _, p in state.plan()]
            state.close()
        out[name] = result
    return out


class Net(torch.nn.Module):
    """A user-defined model: Dynamo compiles its forward (it skips torch.nn's own classes at the
    top of a frame, such as a bare Sequential called by DDP)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(784, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 10))

    def forward(self, x):
        return self.layers(x)


def scenario_compile(args) -> Dict:
    """torch.compile'd DDP with the hook in each optimize_ddp mode, against the same compiled
    model with DDP's allreduce (codec none on 2 ranks: equal bit for bit)."""
    import torch._dynamo

    def run(backend: str, hooked: bool, compiled_autograd: bool = False) -> Dict:
        torch._dynamo.reset()
        graphs = []

        def counting(gm, example_inputs):  # DDPOptimizer compiles one graph per bucket
            graphs.append(len(gm.graph.nodes))
            return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

        # Two buckets of 1 MiB or more: the last two layers, then the first (DDPOptimizer
        # wants the first bucket, 1 MiB by default, no larger than the others).
        net = Net()
        model = DDP(net, bucket_cap_mb=1)
        state = None
        if hooked:
            state, hook = terse.torch.ddp_hook(model, codec="none", threads=2, timeout=20)
            model.register_comm_hook(state, hook)
        compiled = torch.compile(model, backend=counting)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        losses = []
        start = time.perf_counter()
        try:
            for step in range(args.steps):
                x, y = batch(step)
                optimizer.zero_grad()
                loss = F.cross_entropy(compiled(x), y)
                if compiled_autograd:
                    with torch._dynamo.compiled_autograd._enable(
                            torch.compile(backend=backend)):
                        loss.backward()
                else:
                    loss.backward()
                optimizer.step()
                losses.append(loss.item())
        except Exception as e:
            return {"failed": type(e).__name__, "message": str(e)}
        finally:
            if state is not None:
                state.close()
        return {"digest": digest(net), "losses": losses, "graphs": len(graphs),
                "steps": state.steps if state else None,
                "buckets": state.buckets if state else None,
                "seconds": time.perf_counter() - start}

    out = {}
    # aot_eager: Dynamo, DDPOptimizer's graph split and AOTAutograd as inductor has them, without
    # inductor's code generation (minutes of C++ compiles on a busy 2-core machine).
    backend = os.environ.get("TERSE_TEST_COMPILE_BACKEND", "aot_eager")
    for mode, optimize_ddp in (("ddp_optimizer", True), ("no_optimization", False)):
        torch._dynamo.config.optimize_ddp = optimize_ddp
        out[mode] = {"ddp": run(backend, False), "none": run(backend, True)}
    # Compiled autograd with the C++ reducer: torch refuses it, with or without a hook.
    torch._dynamo.config.optimize_ddp = True
    out["compiled_autograd"] = run("aot_eager", True, compiled_autograd=True)
    # The Python reducer calls hooks per gradient: ddp_hook refuses the model, and the hook
    # itself refuses a (gradient, parameter) pair when it was made without the model.
    torch._dynamo.config.optimize_ddp = "python_reducer"
    model = DDP(Net())
    out["python_reducer"] = {}
    try:
        terse.torch.ddp_hook(model, codec="none", timeout=20)
    except terse.InvalidArgument as e:
        out["python_reducer"]["refused"] = str(e)
    state, hook = terse.torch.ddp_hook(codec="none", threads=2, timeout=20)
    model.register_comm_hook(state, hook)
    x, y = batch(0)
    try:
        F.cross_entropy(model(x), y).backward()
    except Exception as e:
        out["python_reducer"]["hook"] = f"{type(e).__name__}: {e}"
        out["python_reducer"]["error_type"] = type(state.error).__name__
    state.close()
    torch._dynamo.config.optimize_ddp = True
    return out


def scenario_disagree(args) -> Dict:
    rank = dist.get_rank()
    start = None
    state = None
    try:
        if args.codecs == ["names"]:
            # The same shapes (DDP's own check passes) under other names on rank 1.
            net = make_model()
            if rank == 1:
                net = torch.nn.Sequential(collections.OrderedDict(
                    (f"layer{name}", m) for name, m in net.named_children()))
        else:  # shapes: rank 1's hidden layer is wider
            torch.manual_seed(1234)
            hidden = 64 + rank
            net = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                      torch.nn.Linear(128, hidden), torch.nn.ReLU(),
                                      torch.nn.Linear(hidden, 10))
        start = time.monotonic()  # DDP checks shapes here, the hook names at the first step
        model = DDP(net, bucket_cap_mb=BUCKET_CAP_MB)
        state, hook = terse.torch.ddp_hook(model, codec="fp16", min_bytes=MIN_BYTES, threads=2,
                                           timeout=5)
        model.register_comm_hook(state, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        train(model, optimizer, 0, 2)
    except Exception as e:
        return {"failed": True, "raised": type(e).__name__, "message": str(e),
                "error_type": type(state.error).__name__ if state and state.error else None,
                "error": str(state.error) if state and state.error else None,
                "seconds": time.monotonic() - start}
    return {"failed": False}


def scenario_sparse(args) -> Dict:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(100, 8, sparse=True), torch.nn.Flatten(),
                              torch.nn.Linear(32, 2))
    model = DDP(net)
    out = {}
    try:
        terse.torch.ddp_hook(model, codec="none", timeout=20)
        out["refused"] = None
    except terse.InvalidArgument as e:
        out["refused"] = str(e)
    # Made without the model, the hook meets the sparse bucket itself.
    state, hook = terse.torch.ddp_hook(codec="none", threads=2, timeout=20)
    model.register_comm_hook(state, hook)
    try:
        model(torch.randint(0, 100, (4, 4))).sum().backward()
        out["hook"] = None
    except Exception as e:
        out["hook"] = str(e)
        out["error_type"] = type(state.error).__name__
    state.close()
    return out


SCENARIOS = {"train": scenario_train, "resume": scenario_resume, "kill": scenario_kill,
             "stall": scenario_kill, "mismatch": scenario_mismatch,
             "features": scenario_features, "warmup": scenario_warmup,
             "compile": scenario_compile, "disagree": scenario_disagree,
             "sparse": scenario_sparse}


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
