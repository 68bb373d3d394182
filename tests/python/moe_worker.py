"""One rank of the MoE tests (tests/python/test_moe.py), started by `terse run`.

Modes (argv[1]):
  check CODEC...  runs one MoE layer forward and backward on this rank's tokens with the exact
                  exchange and with terse's exchange of each codec, and compares both with a
                  reference every rank computes alone from every rank's experts and tokens
                  (gathered exactly); writes the largest differences to --out/rank-R.json
  badcodec        creates a TerseExchange with an unknown codec; records the error
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import terse
import terse.moe

WIDTH, HIDDEN, PER_RANK, TOKENS = 16, 32, 2, 24


def tokens_of(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(100 + rank))


def reference(layer: terse.moe.MoE, everyone: list, experts: list, capacity: int) -> list:
    """Each rank's MoE output computed here alone: the same routing, capacity and weights."""
    outs = []
    for x in everyone:
        probs = F.softmax(layer.gate(x), -1)
        weight, expert = probs.max(-1)
        out = torch.zeros_like(x)
        seen = [0] * layer.experts_total
        for t in range(len(x)):
            e = int(expert[t])
            if seen[e] < capacity:
                out[t] = experts[e](x[t:t + 1])[0] * weight[t]
            seen[e] += 1
        outs.append(out)
    return outs


def check(args: argparse.Namespace) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {}
    everyone = [tokens_of(r) for r in range(world)]
    capacity = -(-int(1.25 * TOKENS) // (world * PER_RANK))
    for name in ["torch"] + args.codecs:
        exchange = (terse.moe.TorchExchange() if name == "torch"
                    else terse.moe.TerseExchange(codec=name, timeout=60))
        torch.manual_seed(0)
        layer = terse.moe.MoE(WIDTH, HIDDEN, PER_RANK, exchange, name=f"layer-{name}")
        # Every rank's experts, gathered exactly, for the reference.
        flat = torch.cat([p.detach().reshape(-1) for p in layer.expert_parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        experts = []
        for r in range(world):
            torch.manual_seed(0)
            offset = 0
            for e in range(PER_RANK):
                module = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(),
                                             torch.nn.Linear(HIDDEN, WIDTH))
                with torch.no_grad():
                    for p in module.parameters():
                        p.copy_(gathered[r][offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
                experts.append(module)
        x = everyone[rank].clone().requires_grad_(True)
        y = layer(x)
        y.square().sum().backward()
        with torch.no_grad():
            expected = reference(layer, everyone, experts, capacity)[rank]
        ref_x = everyone[rank].clone().requires_grad_(True)
        ref_y = reference(layer, [ref_x if r == rank else everyone[r] for r in range(world)],
                          experts, capacity)[rank]
        # The reference's input gradient counts this rank's tokens through the experts only
        # (the gate's routing is piecewise constant; its weight's gradient flows alike).
        ref_y.square().sum().backward()
        # Relative errors: the norm of the difference over the reference's norm.
        result[name] = {
            "output": float((y.detach() - expected).norm() / expected.norm()),
            "input_grad": float((x.grad - ref_x.grad).norm() / ref_x.grad.norm()),
            "dropped": layer.dropped,
        }
        exchange.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("codecs", nargs="*")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if args.mode == "check":
        result = check(args)
    else:
        try:
            terse.moe.TerseExchange(codec="nonesuch", timeout=30)
            result = {"error": None}
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            result = {"error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(args.out, f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
