"""One rank of tests/python/test_backend.py: collectives and DDP on a process group of the
"terse" torch.distributed backend, compared with a Gloo group over the same ranks. Writes what
the tests check to OUT/rank-R.json."""

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import terse.backend

# Elements of a "large" float tensor: 256 KiB of fp32, above the default 64 KiB threshold.
LARGE = 64 << 10


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().clone()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)  # numpy has no bfloat16
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def data(n: int, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * dist.get_rank() + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def max_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.double() - b.double()).abs().max() / b.double().abs().max()).item())


def error_of(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test checks the type and text
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}


def all_to_all_under_the_policy(gloo) -> dict:
    """all_to_all with large blocks: under the default policy (fp16), under minmax8 on a second
    terse group (against terse.moe's TerseExchange with that codec), with uneven splits whose
    blocks fall on both sides of the threshold, of int64 and inside exact()."""
    import terse.moe

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    block = LARGE // 2  # 128 KiB of fp32 a block: above the 64 KiB threshold

    def versus_gloo(x, recv, group=None, send=None):
        o = torch.empty(sum(recv), dtype=x.dtype)
        ref = torch.empty(sum(recv), dtype=x.dtype)
        dist.all_to_all_single(o, x, output_split_sizes=recv, input_split_sizes=send,
                               group=group)
        dist.all_to_all_single(ref, x, output_split_sizes=recv, input_split_sizes=send,
                               group=gloo)
        return o, ref

    even = [block] * world
    x = data(world * block, salt=7)
    o, ref = versus_gloo(x, even)
    mine = slice(rank * block, (rank + 1) * block)
    out["all_to_all_fp16"] = {"error": max_relative(o, ref),
                              "own_exact": bool(torch.equal(o[mine], ref[mine]))}

    terse.backend.configure(all_to_all_codec="minmax8")
    minmax8 = dist.new_group(backend="terse")
    terse.backend.configure(all_to_all_codec=os.environ.get("TERSE_BACKEND_CODEC", "fp16"))
    o, ref = versus_gloo(x, even, group=minmax8)
    exchange = terse.moe.TerseExchange(codec="minmax8")
    moe = exchange(x.view(world, block), "policy").view(-1)
    exchange.close()
    out["all_to_all_minmax8"] = {"error": max_relative(o, ref),
                                 "same_as_moe": bool(torch.equal(o, moe))}

    # Uneven splits: a rank sends a whole block (fp16) to the ranks above it, a quarter (below the
    # threshold: raw, exact) to those below it, and half (at the threshold) to itself.
    def split(sender, receiver):
        return block if sender < receiver else block // 4 if sender > receiver else block // 2

    send = [split(rank, j) for j in range(world)]
    recv = [split(j, rank) for j in range(world)]
    x = data(sum(send), salt=8)
    o, ref = versus_gloo(x, recv, send=send)
    small_exact, large_error, at = True, 0.0, 0
    for n in recv:
        got, want = o[at:at + n], ref[at:at + n]
        if n * 4 < (64 << 10):
            small_exact = small_exact and bool(torch.equal(got, want))
        elif n:
            large_error = max(large_error, max_relative(got, want))
        at += n
    out["all_to_all_mixed"] = {"small_exact": small_exact, "large_error": large_error}

    x = data(world * block, dtype=torch.int64, salt=9)
    o, ref = versus_gloo(x, even)
    out["all_to_all_int64_exact"] = bool(torch.equal(o, ref))
    x = data(world * block, salt=10)
    with terse.backend.exact():
        o, ref = versus_gloo(x, even)
    out["all_to_all_exact"] = bool(torch.equal(o, ref))
    return out


def scenario_collectives(args) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    out = {"backend": dist.get_backend()}

    # allreduce: raw (small), compressed (large), exact-marked, AVG, integers.
    for key, n, dtype in (("small", 1000, torch.float32), ("large", LARGE, torch.float32),
                          ("int", 1000, torch.int64), ("bf16", LARGE, torch.bfloat16)):
        x, ref = data(n, dtype), data(n, dtype)
        dist.all_reduce(x)
        dist.all_reduce(ref, group=gloo)
        out[f"allreduce_{key}"] = {"digest": digest(x), "error": max_relative(x, ref),
                                   "equal": bool(torch.equal(x, ref))}
    x, ref = data(LARGE, salt=1), data(LARGE, salt=1)
    with terse.backend.exact():
        dist.all_reduce(x)
    dist.all_reduce(ref, group=gloo)
    out["allreduce_exact"] = {"digest": digest(x), "error": max_relative(x, ref)}
    x, ref = data(1000, salt=2), data(1000, salt=2)
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    dist.all_reduce(ref, group=gloo)
    out["allreduce_avg"] = {"error": max_relative(x, ref / world)}
    work = dist.all_reduce(data(10), async_op=True)
    out["async_future"] = [float(v) for v in work.get_future().wait()[0][:2]]

    # broadcast from the last rank
    x = data(1000, salt=3)
    dist.broadcast(x, src=world - 1)
    ref = data(1000, salt=3)
    dist.broadcast(ref, src=world - 1, group=gloo)
    out["broadcast_equal"] = bool(torch.equal(x, ref))

    # all_gather (list and into one tensor), floats and integers
    for key, dtype in (("float", torch.float32), ("int", torch.int32)):
        x = data(300, dtype, salt=4)
        outs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(outs, x)
        refs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(refs, x, group=gloo)
        single = torch.empty(world * 300, dtype=dtype)
        dist.all_gather_into_tensor(single, x)
        out[f"all_gather_{key}"] = all(torch.equal(a, b) for a, b in zip(outs, refs)) and \
            torch.equal(single, torch.cat(refs))

    # reduce_scatter (list and tensor), raw and compressed
    for key, n in (("small", 100), ("large", LARGE // world)):
        x = data(world * n, salt=5)
        o = torch.empty(n)
        dist.reduce_scatter_tensor(o, x)
        full = x.clone()
        dist.all_reduce(full, group=gloo)
        ref = full[rank * n:(rank + 1) * n]
        o2 = torch.empty(n)
        dist.reduce_scatter(o2, list(x.view(world, n).unbind(0)))
        out[f"reduce_scatter_{key}"] = {"error": max_relative(o, ref),
                                        "error_list": max_relative(o2, ref)}

    # all_to_all: even, uneven splits, lists
    x = torch.arange(world * 4, dtype=torch.float32) + 100 * rank
    o = torch.empty(world * 4)
    dist.all_to_all_single(o, x)
    ref = torch.empty(world * 4)
    dist.all_to_all_single(ref, x, group=gloo)
    out["all_to_all_even"] = bool(torch.equal(o, ref))
    # rank r sends (r + j + 1) elements to rank j
    send = [rank + j + 1 for j in range(world)]
    recv = [j + rank + 1 for j in range(world)]
    x = torch.arange(sum(send), dtype=torch.int64) + 1000 * rank
    o = torch.empty(sum(recv), dtype=torch.int64)
    dist.all_to_all_single(o, x, output_split_sizes=recv, input_split_sizes=send)
    ref = torch.empty(sum(recv), dtype=torch.int64)
    dist.all_to_all_single(ref, x, output_split_sizes=recv, input_split_sizes=send, group=gloo)
    out["all_to_all_uneven"] = bool(torch.equal(o, ref))
    ins = [torch.full((3,), float(rank * 10 + j)) for j in range(world)]
    outs = [torch.empty(3) for _ in range(world)]
    dist.all_to_all(outs, ins)
    out["all_to_all_list"] = all(torch.equal(outs[j], torch.full((3,), float(j * 10 + rank)))
                                 for j in range(world))

    out.update(all_to_all_under_the_policy(gloo))

    dist.barrier()
    out["barrier"] = True

    # what terse refuses
    out["unsupported"] = {
        "send": error_of(lambda: dist.send(torch.zeros(1), dst=(rank + 1) % world)),
        "max": error_of(lambda: dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.MAX)),
        "gather": error_of(lambda: dist.gather(
            torch.zeros(1), [torch.zeros(1) for _ in range(world)] if rank == 0 else None,
            dst=0)),
    }
    dist.barrier()
    return out


def mlp() -> nn.Module:
    torch.manual_seed(0)
    # 256x256 weights (256 KiB) are compressed, the rest travels raw.
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def scenario_ddp(args) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    gloo = dist.new_group(backend="gloo")
    result = {}
    for key, group in (("terse", None), ("gloo", gloo)):
        model = DDP(mlp(), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1000 + dist.get_rank())
        x = torch.randn(32, 32, generator=g)
        y = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
        losses = []
        for _ in range(args.steps):
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        result[key] = {"losses": losses, "digest": digest(params),
                       "params": params[:2000].tolist()}
        del model
    a, b = torch.tensor(result["terse"]["params"]), torch.tensor(result["gloo"]["params"])
    result["difference"] = float((a - b).abs().max())
    dist.barrier()
    return result


def scenario_fsdp(args) -> dict:
    """FSDP2 with the terse group for its all-gathers and reduce-scatters."""
    from torch.distributed.fsdp import fully_shard
    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1000 + dist.get_rank()))
    y = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(args.steps):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])
    return {"losses": losses, "digest": digest(params)}


def scenario_uncaught(args) -> dict:
    """Rank 0 expects one element more from rank 1 than it sends in a compressed all_to_all: the
    MismatchError reaches every rank, and nobody catches it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    send, recv = [LARGE] * world, [LARGE] * world
    if rank == 0:
        recv[1] += 1
    o = torch.empty(sum(recv))
    dist.all_to_all_single(o, data(sum(send)), output_split_sizes=recv, input_split_sizes=send)
    return {}


SCENARIOS = {"collectives": scenario_collectives, "ddp": scenario_ddp, "fsdp": scenario_fsdp,
             "uncaught": scenario_uncaught}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=sorted(SCENARIOS) + ["bad_codec"])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--backend", default="cpu:terse")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.scenario == "bad_codec":
        os.environ["TERSE_BACKEND_CODEC"] = "nosuchcodec"
        try:
            dist.init_process_group(args.backend)
            result = {"error": None}
        except Exception as e:  # noqa: BLE001 - the test checks the type and text
            result = {"error": type(e).__name__, "message": str(e)}
        path = os.path.join(args.out, f"rank-{os.environ['RANK']}.json")
        with open(path, "w") as f:
            json.dump(result, f)
        return
    dist.init_process_group(args.backend)
    result = SCENARIOS[args.scenario](args)
    result["rank"] = dist.get_rank()
    path = os.path.join(args.out, f"rank-{dist.get_rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
