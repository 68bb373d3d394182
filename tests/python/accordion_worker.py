"""One rank of the multi-process tests of the hook's codec schedules (terse.Accordion,
terse.SparseWarmup), started by `terse run`. Each rank writes OUT/rank-R.json.

Scenarios:
  levels                trains under Accordion(powersgd r1, r4) with windows of WINDOW steps and
                        a learning-rate drop (read from the optimizer) at step LR_DROP; records
                        each parameter's spec at every step and a digest of the parameters
  warmup                trains under SparseWarmup(topk 1%) with windows of WINDOW steps;
                        records the specs and the digest
  resume save|load      save: trains BEFORE steps under Accordion (stopping inside a window),
                        checkpoints model, optimizer and hook state, trains AFTER more; load:
                        restores the checkpoint in fresh processes and trains the same AFTER
                        steps, with the hook state and without it (the control)
  auto                  trains under Accordion("auto:heavy", "auto") (codec auto's two tiers:
                        fp16 light, onebit with error feedback heavy) with windows of WINDOW
                        steps and a learning-rate drop at LR_DROP, the search restricted to
                        sharded; records each parameter's level and the plan the planner made
                        of it at every step, and the digest
  disagree              rank 1's Accordion has another eta than the others'
  clip                  one step with codec none and clip_norm CLIP: records the norms of the
                        averaged gradients, with and without clipping
"""

import argparse
import json
import os
import sys
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import terse
import terse.torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_worker import BUCKET_CAP_MB, LR, MIN_BYTES, batch, digest, make_model  # noqa: E402

WINDOW = 3
LR_DROP = 10
STEPS = 16
BEFORE, AFTER = 7, 6  # 7 steps: two windows of 3 and one step into the third


def accordion(eta: float = 0.9) -> terse.Accordion:
    # eta 0.9: a window is critical only when its gradient norm nearly doubles or vanishes, so
    # regular windows (heavy) follow the first two (light) in these few steps.
    return terse.Accordion("powersgd:rank=1", "powersgd:rank=4", eta=eta, window_steps=WINDOW)


def setup(codec, **knobs):
    model = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    state, hook = terse.torch.ddp_hook(model, codec=codec, min_bytes=MIN_BYTES, threads=2,
                                       timeout=20, **knobs)
    model.register_comm_hook(state, hook)
    return model, optimizer, state


def step(model, optimizer, index: int) -> float:
    x, y = batch(index)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def specs_now(state) -> Dict[str, str]:
    return {name: options.codec for name, options in sorted(state._options.items())
            if not state._raw[name]}


def scenario_levels(args) -> Dict:
    model, optimizer, state = setup(accordion())
    state.watch(optimizer)
    specs: List[Dict[str, str]] = []
    losses = []
    for i in range(STEPS):
        if i == LR_DROP:
            for group in optimizer.param_groups:
                group["lr"] *= 0.1
        losses.append(step(model, optimizer, i))
        specs.append(specs_now(state))
    out = {"specs": specs, "losses": losses, "digest": digest(model),
           "critical": state.schedule.critical, "previous": state.schedule.previous,
           "windows": state.schedule.windows, "plan": [
               (name, plan.codec) for name, _, plan in state.plan()]}
    state.close()
    return out


def scenario_warmup(args) -> Dict:
    model, optimizer, state = setup(terse.SparseWarmup("topk:ratio=0.01,ef=1", stages=2,
                                                       window_steps=WINDOW))
    specs = []
    for i in range(4 * WINDOW):
        step(model, optimizer, i)
        specs.append(specs_now(state))
    out = {"specs": specs, "digest": digest(model)}
    state.close()
    return out


def scenario_resume(args) -> Dict:
    rank = dist.get_rank()
    path = os.path.join(args.checkpoint, f"accordion-rank{rank}.pt")
    if args.phase == "save":
        model, optimizer, state = setup(accordion())
        for i in range(BEFORE):
            step(model, optimizer, i)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "terse": state.state_dict()}, path)
        for i in range(BEFORE, BEFORE + AFTER):
            step(model, optimizer, i)
        out = {"continued": digest(model), "specs": specs_now(state)}
        state.close()
        return out
    out = {}
    for with_state in (True, False):
        checkpoint = torch.load(path)
        model, optimizer, state = setup(accordion())
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if with_state:
            state.load_state_dict(checkpoint["terse"])
        for i in range(BEFORE, BEFORE + AFTER):
            step(model, optimizer, i)
        out["resumed" if with_state else "resumed_without_hook_state"] = digest(model)
        state.close()
    return out


CLIP = 1e-3


def scenario_clip(args) -> Dict:
    out = {}
    for clip in (CLIP, None):
        model, optimizer, state = setup("none", clip_norm=clip)
        x, y = batch(0)
        F.cross_entropy(model(x), y).backward()
        out[str(clip)] = {name: float(p.grad.norm()) for name, p in
                          model.module.named_parameters()}
        out["raw"] = sorted(name for name, raw in state._raw.items() if raw)
        state.close()
    return out


LIGHT, HEAVY = "fp16", "onebit:ef=1"


def scenario_auto(args) -> Dict:
    codec = terse.Accordion("auto:heavy", "auto", eta=0.9, window_steps=WINDOW)
    # Sharded: raw is no candidate, so every compressed parameter runs a codec of its tier.
    model, optimizer, state = setup(codec, strategy="sharded", auto_codecs=[LIGHT],
                                    heavy_codecs=[HEAVY])
    state.watch(optimizer)
    specs: List[Dict[str, str]] = []
    plans: List[Dict[str, str]] = []
    for i in range(STEPS):
        if i == LR_DROP:
            for group in optimizer.param_groups:
                group["lr"] *= 0.1
        step(model, optimizer, i)
        now = specs_now(state)
        specs.append(now)
        plans.append({name: plan.codec for name, _, plan in state.plan() if name in now})
    out = {"specs": specs, "plans": plans, "digest": digest(model),
           "light": terse.canonical_spec(LIGHT), "heavy": terse.canonical_spec(HEAVY),
           "saved": sorted(state.state_dict())}
    state.close()
    return out


def scenario_disagree(args) -> Dict:
    eta = 0.6 if dist.get_rank() == 1 else 0.5
    model, optimizer, state = setup(accordion(eta))
    try:
        step(model, optimizer, 0)
    except Exception as e:  # noqa: B902 - DDP re-raises the hook's error as RuntimeError
        error = state.error
        out = {"failed": True, "message": str(e), "error": str(error),
               "error_type": type(error).__name__}
    else:
        out = {"failed": False}
    state.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("phase", nargs="?")
    p.add_argument("--checkpoint")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    out = globals()[f"scenario_{args.scenario}"](args)
    with open(os.path.join(args.out, f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
