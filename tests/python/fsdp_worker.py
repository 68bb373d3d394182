"""One rank of the FSDP and torch.distributed-backend tests (tests/python/test_fsdp.py,
test_backend.py): trains a small MLP under FSDP2 (Gloo for FSDP's own collectives) or DDP on the
"terse" backend, and writes what the tests compare to OUT/rank-R.json."""

import argparse
import copy
import gc
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import terse

STEPS = 8
LR = 0.2
# Weights of the MLP are 8-16 KiB: compressed above this, biases raw.
MIN_BYTES = 1024


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def batch(step: int):
    """This rank's batch of a fixed regression task (targets from a fixed teacher); the same
    every step, so that a few steps visibly lower the loss."""
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    x = torch.randn(16, 32, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(32, 10, generator=teacher) / 4
    return x, torch.tanh(x @ w)


def sharded(all_gather_codec=None, codec=None, reshard_after_forward=True, **knobs):
    """An FSDP2 MLP (each Linear its own FSDP module), compressed by terse unless codec is
    None; returns (model, terse state or None)."""
    from torch.distributed.fsdp import fully_shard
    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    state = None
    if codec is not None:
        import terse.fsdp
        state = terse.fsdp.compress(model, codec=codec, all_gather_codec=all_gather_codec,
                                    min_bytes=MIN_BYTES, **knobs)
    return model, state


def train(model, steps, first=0, forward_hook=None):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(first, first + steps):
        x, y = batch(step)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def full_params(model):
    """Every parameter in full (gathered from the shards), as lists, and their digest."""
    h = hashlib.sha256()
    values = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        full = full.detach().contiguous()
        h.update(full.numpy().tobytes())
        values[name] = full.flatten().tolist()
    return values, h.hexdigest()


def scenario_train(args):
    result = {}
    for codec in args.codecs:
        spec = None if codec == "default" else codec
        knobs = {"auto_codecs": args.auto_codecs.split(",")} if args.auto_codecs else {}
        model, state = sharded(codec=spec, all_gather_codec=args.all_gather_codec, **knobs)
        gathered = []
        if args.all_gather_codec:
            # The weight FSDP gathered for this forward (the unsharded parameter).
            def grab(module, inputs):
                w = module.weight
                w = w.to_local() if hasattr(w, "to_local") else w
                w = w.detach().clone()
                gathered.append(hashlib.sha256(w.numpy().tobytes()).hexdigest())
                gathered.append(w.flatten()[:64].tolist())
            model[2].register_forward_pre_hook(grab)
        losses = train(model, args.steps)
        values, digest = full_params(model)
        result[codec] = {"losses": losses, "params": values, "digest": digest,
                         "gathered": gathered[-2:] if gathered else None}
        if state is not None:
            result[codec]["bytes_sent"] = state.bytes_sent
            result[codec]["reduce_scatters"] = state.reduce_scatters
            result[codec]["all_gathers"] = state.all_gathers
            state.close()
        del model
        gc.collect()
    return result


def scenario_hosts(args):
    """Two hosts of two ranks (TERSE_TOPOLOGY=2,2): FSDP's default, then terse's 8-bit
    reduce-scatter and all-gather flat, in two levels, and in two levels with the backward's
    gathers from a secondary shard inside each host (reshard_after_forward=2, hpZ)."""
    os.environ["TERSE_TOPOLOGY"] = "2,2"
    runs = {"default": {}, "flat": {"hierarchy": "flat"}, "hosts": {"hierarchy": "hosts"},
            "hpz": {"hierarchy": "hosts", "reshard_after_forward": 2}}
    result = {}
    for label, knobs in runs.items():
        codec = None if label == "default" else "minmax8:ef=1"
        model, state = sharded(codec=codec, all_gather_codec="minmax8" if codec else None,
                               **knobs)
        losses = train(model, args.steps)
        values, digest = full_params(model)
        result[label] = {"losses": losses, "params": values, "digest": digest}
        if state is not None:
            result[label].update(across=state.bytes_sent_across_hosts,
                                 subgroup_gathers=state.subgroup_gathers, hpz=state.hpz,
                                 hosts=state.engine.hosts)
            state.close()
        del model
        gc.collect()
    return result


def scenario_checkpoint(args):
    """Trains 2k steps straight; and k steps, a checkpoint (shards and terse state), then k
    steps of a fresh model restored from it; and the same without terse's state."""
    codec = args.codecs[0]
    k = args.steps // 2
    straight, state = sharded(codec=codec)
    train(straight, k)
    shards = {n: p.to_local().detach().clone() for n, p in straight.named_parameters()}
    saved = copy.deepcopy(state.state_dict())
    train(straight, k, first=k)
    _, digest_straight = full_params(straight)
    state.close()

    digests = {}
    for restore in (True, False):
        model, st = sharded(codec=codec)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.to_local().copy_(shards[n])
        if restore:
            st.load_state_dict(saved)
        train(model, k, first=k)
        digests[restore] = full_params(model)[1]
        st.close()
    return {"straight": digest_straight, "restored": digests[True],
            "without_state": digests[False]}


def scenario_bad_codec(args):
    model, _ = sharded()
    try:
        import terse.fsdp
        terse.fsdp.compress(model, codec=args.codecs[0])
    except terse.Error as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def scenario_fsdp1(args):
    """FSDP1 (FullyShardedDataParallel on CPU) with terse's sharded hook, and without."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    import terse.fsdp
    result = {}
    for codec in args.codecs:
        model = FSDP(mlp(), device_id=torch.device("cpu"), use_orig_params=True)
        state = None
        if codec != "default":
            state = terse.fsdp.fsdp1_hook(model, codec=codec, min_bytes=MIN_BYTES)
        losses = train(model, args.steps)
        with FSDP.summon_full_params(model):
            h = hashlib.sha256()
            values = {}
            for name, p in model.named_parameters():
                full = p.detach().clone()  # numpy() would pin FSDP's storage
                h.update(full.numpy().tobytes())
                values[name] = full.flatten().tolist()
        result[codec] = {"losses": losses, "digest": h.hexdigest(), "params": values}
        if state is not None:
            result[codec]["reduce_scatters"] = state.reduce_scatters
            state.close()
        del model
        gc.collect()
    return result


SCENARIOS = {"train": scenario_train, "checkpoint": scenario_checkpoint, "hosts": scenario_hosts,
             "bad_codec": scenario_bad_codec, "fsdp1": scenario_fsdp1}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("codecs", nargs="*")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--all-gather-codec", default=None)
    p.add_argument("--auto-codecs", default=None, help="codec auto's allowed specs, by commas")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = SCENARIOS[args.scenario](args)
    result["rank"] = dist.get_rank()
    path = os.path.join(args.out, f"rank-{dist.get_rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
