#!/usr/bin/python3
"""The training benchmark: DistributedDataParallel's own fp32 allreduce, PyTorch's fp16 and
PowerSGD communication hooks, and the terse hook with several codecs (and codec=auto) train the
same models from the same initial weights on the same batches, 4 ranks on the same emulated
cluster (scripts/cluster.sh: one network namespace per host), at several link rates.

    bench/train.py run --link 1gbit [--models mlp,cnn,vgg-small] [--methods ddp,terse-fp16,...]
    bench/train.py report [--results results/train] [--update docs/training.md] [--plots docs]
    bench/train.py list                    # the matrix: models, methods, budgets
    bench/train.py run --link loopback --dtype bfloat16   # the model (and gradients) in bf16
    bench/train.py run --link loopback --model gpt --methods ddp,terse-fp16,compute-only
                                           # the language model (AdamW, validation loss)

`run` trains every (model, method) of one link rate ("unshaped", "1gbit", "100mbit", or
"loopback": local processes without an emulated network) and writes one JSON per configuration,
results/train/<link>/<model>/<method>.json, with every rank's output beside it (.log). A
configuration whose JSON exists is skipped, so an interrupted run resumes where it stopped
(--force runs it again). `report` reads every JSON, prints markdown tables (throughput,
time to accuracy, bytes, where the time goes, the issue's targets met or missed), replaces the
part of --update between the markers `<!-- training-report:begin -->` and `<!-- ...:end -->`,
and draws the plots (python3-matplotlib) into --plots. bench/train.sh runs everything.

Each run (terse_harness.training) measures: samples/s (global batch over the median step time after
the warm-up steps), test accuracy every 1/evals-per-epoch epoch and at the end (evaluation time
is excluded from the training clock, for every method), the training time until the model's
target accuracy is first reached, the bytes each rank sent per step as counted by the kernel on
its emulated host's interface (the same measurement for every method; terse also reports its own
payload count), forward/backward/optimizer time per step, and a digest of every rank's
parameters. "compute only" runs every step without communicating (each rank keeps its own
gradient): the compute floor of a step, against which communication time is
(step time - floor).

The language model (gpt: a byte-level GPT on Debian's fortunes, AdamW; terse_harness.lm) trains
a fixed number of steps and reports validation loss (nats per byte) instead of test accuracy:
its final value and the training time until the model's target loss is first reached; with the
floor in the race, each method's time to the target over the floor's time for as many steps.
It is not in the default --models; name it (--model gpt).
"""

import argparse
import glob
import json
import os
import sys
import time
from typing import Dict, Iterable, List, Optional, Tuple

from terse_harness.training import DILOCO_METHODS, MODELS, RunConfig, launch, method_label

# ---- the matrix -----------------------------------------------------------------------------

# DGC's warm-up as a codec schedule: four windows of a quarter epoch each.
_WARMUP = dict(sparse_warmup=4, windows_per_epoch=4)

# (name, RunConfig fields). The name is the JSON's file name and what --methods selects.
METHODS: List[Tuple[str, Dict]] = [
    ("ddp", dict(method="ddp")),
    ("ddp-sgd", dict(method="ddp", momentum=0.0)),  # the reference of plain-SGD methods
    ("ddp-fp16", dict(method="ddp-fp16")),
    ("ddp-bf16", dict(method="ddp-bf16")),  # torch 2.x
    ("ddp-powersgd-r1", dict(method="ddp-powersgd", powersgd_rank=1)),
    ("ddp-powersgd-r4", dict(method="ddp-powersgd", powersgd_rank=4)),
    ("ddp-powersgd-r8", dict(method="ddp-powersgd", powersgd_rank=8)),
    # PyTorch's batched_powerSGD_hook (one matrix per bucket) is not in the matrix: it fails on
    # its first compressed step in torch 1.13 and in 2.15.0 alike (_orthogonalize asserts a
    # batch of matrices and is handed one); terse_harness.training's method
    # ddp-powersgd-batched runs it.
    ("terse-powersgd-r1", dict(method="terse", codec="powersgd:rank=1")),
    ("terse-powersgd-r2", dict(method="terse", codec="powersgd:rank=2")),
    ("terse-powersgd-r4", dict(method="terse", codec="powersgd")),
    ("terse-powersgd-r8", dict(method="terse", codec="powersgd:rank=8")),
    # The factors' sums in fp16: half the bytes of r8, N message steps a round instead of 2(N-1).
    ("terse-powersgd-r8-fp16", dict(method="terse", codec="powersgd:rank=8,wire=fp16")),
    # The rounds' sums gathered: one message step a round (for latency-bound links).
    ("terse-powersgd-r8-ag", dict(method="terse", codec="powersgd:rank=8",
                                  strategy="allgather")),
    ("terse-powersgd-r8-fp16-ag", dict(method="terse", codec="powersgd:rank=8,wire=fp16",
                                       strategy="allgather")),
    ("terse-fp16", dict(method="terse", codec="fp16")),
    ("terse-minmax8", dict(method="terse", codec="minmax8:ef=1")),
    # DDP's buckets at 2 MB instead of 25: the exchange starts during the backward pass.
    ("terse-minmax8-b2", dict(method="terse", codec="minmax8:ef=1", bucket_mb=2.0)),
    ("terse-minmax4", dict(method="terse", codec="minmax8:bits=4,ef=1")),
    ("terse-minmax4-b2", dict(method="terse", codec="minmax8:bits=4,ef=1", bucket_mb=2.0)),
    # On hosts of several ranks (--ranks-per-host): terse flat, every rank its own host, against
    # the default two levels (docs/topology.md); raw fp32 through terse both ways.
    ("terse-minmax8-flat", dict(method="terse", codec="minmax8:ef=1", topology="flat")),
    ("terse-raw", dict(method="terse", codec="none")),
    ("terse-raw-flat", dict(method="terse", codec="none", topology="flat")),
    ("terse-onebit", dict(method="terse", codec="onebit:ef=1")),
    ("terse-topk", dict(method="terse", codec="topk:ratio=0.01,ef=1")),
    ("terse-topk-10", dict(method="terse", codec="topk:ratio=0.1,ef=1")),
    ("terse-randomk", dict(method="terse", codec="randomk:ratio=0.01,ef=1")),
    # DGC's momentum correction sends the momentum inside v: the optimizer runs without its
    # own (docs/codecs/dgc.md), or every step applies it twice.
    ("terse-dgc", dict(method="terse", codec="dgc", momentum=0.0)),
    # The sparsifiers with DGC's warm-up (density 25%, 6.25%, 1.6%, 0.4%, then the target)
    # over the first four quarter epochs (terse.SparseWarmup), and DGC also with its local
    # gradient clipping.
    ("terse-topk-warmup", dict(method="terse", codec="topk:ratio=0.01,ef=1", **_WARMUP)),
    ("terse-randomk-warmup", dict(method="terse", codec="randomk:ratio=0.01,ef=1", **_WARMUP)),
    # The sparsifiers with DGC's momentum correction and factor masking around error feedback
    # (ef=1,momentum=0.9: the momentum travels in what is sent, the optimizer runs without).
    ("terse-randomk-mc-warmup", dict(method="terse", codec="randomk:ratio=0.01,ef=1,momentum=0.9",
                                     momentum=0.0, **_WARMUP)),
    ("terse-topk-mc-warmup", dict(method="terse", codec="topk:ratio=0.01,ef=1,momentum=0.9",
                                  momentum=0.0, **_WARMUP)),
    # Random-k with plain SGD (no optimizer momentum, which multiplies each released residual).
    ("terse-randomk-warmup-sgd", dict(method="terse", codec="randomk:ratio=0.01,ef=1",
                                      momentum=0.0, **_WARMUP)),
    ("terse-randomk-10-warmup-sgd", dict(method="terse", codec="randomk:ratio=0.1,ef=1",
                                         momentum=0.0, **_WARMUP)),
    ("terse-dgc-warmup", dict(method="terse", codec="dgc", momentum=0.0, **_WARMUP)),
    ("terse-dgc-warmup-clip", dict(method="terse", codec="dgc", momentum=0.0, clip_norm=5.0,
                                   **_WARMUP)),
    # Accordion (terse.Accordion): each tensor at its light level in critical regimes and its
    # heavy one elsewhere, decided every quarter epoch (the benchmark trains two epochs).
    ("terse-accordion-powersgd", dict(method="terse",
                                      accordion=("powersgd:rank=1", "powersgd:rank=4"),
                                      windows_per_epoch=4)),
    ("terse-accordion-powersgd-r2-r8", dict(method="terse",
                                            accordion=("powersgd:rank=2", "powersgd:rank=8"),
                                            windows_per_epoch=4)),
    ("terse-accordion-powersgd-r4-r8", dict(method="terse",
                                            accordion=("powersgd:rank=4", "powersgd:rank=8"),
                                            windows_per_epoch=4)),
    ("terse-accordion-topk", dict(method="terse",
                                  accordion=("topk:ratio=0.01,ef=1", "topk:ratio=0.1,ef=1"),
                                  windows_per_epoch=4)),
    # codec "auto" at its default accuracy tiers (docs/planner.md): the light tier alone (fp16,
    # minmax8 with error feedback, PowerSGD r8 with fp32 or fp16 sums), and Accordion between it
    # and both tiers (adding onebit with error feedback and PowerSGD r4) every quarter epoch;
    # and auto among the fastest fixed codecs regardless of accuracy (fp16, onebit with error
    # feedback, PowerSGD rank 4).
    ("terse-auto", dict(method="terse", codec="auto")),
    # The tiers of terse.policy.ADAPTIVE_TIERS: what a model trained with Adam/AdamW asks for.
    ("terse-auto-adam", dict(method="terse", codec="auto", adaptive=True)),
    ("terse-auto-adam-b2", dict(method="terse", codec="auto", adaptive=True, bucket_mb=2.0)),
    ("terse-accordion-auto", dict(method="terse", accordion=("auto:heavy", "auto"),
                                  windows_per_epoch=4)),
    ("terse-auto-fast", dict(method="terse", codec="auto",
                             auto_codecs=("fp16", "onebit:ef=1", "powersgd"))),
    # Sharded data parallelism: FSDP2's fully_shard per layer, its own collectives over Gloo
    # in fp32 and with gradients reduce-scattered in bf16.
    ("fsdp", dict(method="fsdp")),
    ("fsdp-bf16", dict(method="fsdp-bf16")),
    # terse's gradient reduce-scatter (8 bits, error feedback, each contribution quantized
    # once), then also the parameters' all-gather in 8 bits, then gradients in 4 bits (ZeRO++'s
    # qwZ and qgZ).
    ("fsdp-terse", dict(method="fsdp-terse", codec="minmax8:ef=1")),
    ("fsdp-terse-qw", dict(method="fsdp-terse", codec="minmax8:ef=1",
                           all_gather_codec="minmax8")),
    ("fsdp-terse-qw-g4", dict(method="fsdp-terse", codec="minmax8:bits=4,ef=1",
                              all_gather_codec="minmax8")),
    # On hosts of several ranks (--ranks-per-host): the same one level, and in two levels with
    # the backward's parameters gathered from a secondary shard inside each host (hpZ).
    ("fsdp-terse-qw-flat", dict(method="fsdp-terse", codec="minmax8:ef=1",
                                all_gather_codec="minmax8", hierarchy="flat")),
    ("fsdp-terse-qw-hpz", dict(method="fsdp-terse", codec="minmax8:ef=1",
                               all_gather_codec="minmax8", hpz=True)),
    # DDP without a hook on the process group backend "cpu:terse" (fp16 above 64 KiB).
    ("ddp-terse-backend", dict(method="ddp-terse-backend", codec="fp16")),
    # terse.optim's optimizers (AdamW's settings and schedule; they communicate themselves).
    # 1-bit Adam freezes the variance after 40 % of the steps (20 % costs the LM 1.9 % of loss).
    ("onebit-adam", dict(method="ddp", optimizer="onebit-adam", freeze_fraction=0.4)),
    ("zeroone-adam", dict(method="ddp", optimizer="zeroone-adam")),
    ("onebit-adam-f20", dict(method="ddp", optimizer="onebit-adam")),
    ("onebit-adam-deepspeed", dict(method="ddp", optimizer="onebit-adam", freeze_fraction=0.4,
                                   precondition=False)),
    ("zeroone-adam-deepspeed", dict(method="ddp", optimizer="zeroone-adam", precondition=False)),
    # DiLoCo (terse.diloco): AdamW inner steps on each rank alone, every H steps the
    # pseudo-gradients averaged (raw, 8, 4 or 2 bits with error feedback) and an outer Nesterov
    # step (lr 0.7, momentum 0.9); Streaming DiLoCo: 4 fragments on staggered offsets, each
    # exchange overlapped with 5 inner steps and merged half and half. torchft's DiLoCo
    # (terse_harness.torchft_diloco) at the same H and outer optimizer.
    ("diloco-h25", dict(method="diloco", codec="none", sync_every=25)),
    ("diloco-h50", dict(method="diloco", codec="none", sync_every=50)),
    ("diloco-h50-int8", dict(method="diloco", codec="minmax8:ef=1", sync_every=50)),
    ("diloco-h50-int4", dict(method="diloco", codec="minmax8:bits=4,ef=1", sync_every=50)),
    ("diloco-h100-int4", dict(method="diloco", codec="minmax8:bits=4,ef=1", sync_every=100)),
    ("diloco-h50-int2", dict(method="diloco", codec="minmax8:bits=2,ef=1", sync_every=50)),
    ("diloco-h100-int2", dict(method="diloco", codec="minmax8:bits=2,ef=1", sync_every=100)),
    ("streaming-diloco-h50-int4", dict(method="diloco", codec="minmax8:bits=4,ef=1",
                                       sync_every=50, fragments=4, delay=5, mixing=0.5)),
    # Outer steps of lr 1 without momentum (the plain average of the workers' parameters), and
    # the first 10 % of the steps synchronous (gradients averaged with minmax8:ef=1).
    ("diloco-h50-int4-avg", dict(method="diloco", codec="minmax8:bits=4,ef=1", sync_every=50,
                                 outer_lr=1.0, outer_momentum=0.0)),
    ("diloco-h50-int4-avg-warm", dict(method="diloco", codec="minmax8:bits=4,ef=1",
                                      sync_every=50, outer_lr=1.0, outer_momentum=0.0,
                                      diloco_warmup=0.1, warmup_codec="minmax8:ef=1")),
    ("diloco-h100-int2-avg", dict(method="diloco", codec="minmax8:bits=2,ef=1", sync_every=100,
                                  outer_lr=1.0, outer_momentum=0.0)),
    ("diloco-h100-int4-avg-warm", dict(method="diloco", codec="minmax8:bits=4,ef=1",
                                       sync_every=100, outer_lr=1.0, outer_momentum=0.0,
                                       diloco_warmup=0.1, warmup_codec="minmax8:ef=1")),
    ("torchft-diloco-h50", dict(method="torchft-diloco", sync_every=50)),
    ("compute-only", dict(method="local")),
    # Ranks in step bucket by bucket, next to no bytes: what any allreduce costs beyond its
    # bytes on this machine (waiting for the slowest rank, scheduling 4 ranks on the cores).
    ("sync-only", dict(method="sync")),
]
# Floors, not training methods: replicas diverge, accuracy is not measured.
FLOORS = ("compute-only", "sync-only")
BASELINES = ("ddp", "ddp-sgd", "ddp-fp16", "ddp-bf16", "ddp-powersgd-r1", "ddp-powersgd-r4",
             "ddp-powersgd-r8")

# What each model trains for. Fashion-MNIST models: whole epochs with test accuracy every
# quarter epoch (time to accuracy); the synthetic model: a fixed number of steps (throughput).
# The floors need no accuracy: a few dozen steps give their median.
BUDGETS: Dict[str, Dict] = {
    "mlp": dict(epochs=2, evals_per_epoch=4),
    "cnn": dict(epochs=2, evals_per_epoch=4),
    "transformer": dict(epochs=2, evals_per_epoch=4),
    "vgg-small": dict(steps=25),
    # The language model: a fixed number of steps (it has no epochs), validation loss 20 times.
    "gpt": dict(steps=300, evals_per_epoch=20),
}
# What `run` trains without --models: the image models (the published matrix); the language
# model runs when named (--models gpt).
DEFAULT_MODELS = [m for m in MODELS if MODELS[m].task != "lm"]
COMPUTE_ONLY_STEPS = 40
LINKS = ("100mbit", "1gbit", "unshaped")
LINK_NAMES = {"100mbit": "100 Mbit/s", "1gbit": "1 Gbit/s", "unshaped": "unshaped veth",
              "loopback": "loopback"}


def configs(models: Iterable[str], methods: Iterable[str],
            overrides: Dict) -> List[Tuple[str, str, RunConfig]]:
    """(model, method name, RunConfig) of every configuration selected."""
    table = dict(METHODS)
    out = []
    for model in models:
        for name in methods:
            fields = dict(BUDGETS[model], **table[name])
            if name in FLOORS:
                fields.pop("epochs", None)
                fields.update(steps=min(COMPUTE_ONLY_STEPS, fields.get("steps", 10 ** 9)),
                              evals_per_epoch=0)
            own_optimizer = table[name].get("optimizer")
            fields.update(overrides)
            if own_optimizer:  # a method that is an optimizer keeps it
                fields["optimizer"] = own_optimizer
            fields["model"] = model
            out.append((model, name, RunConfig(**fields)))
    return out


def _split(value: str, allowed: Iterable[str], what: str) -> List[str]:
    items = [v for v in value.split(",") if v]
    unknown = [v for v in items if v not in allowed]
    if unknown:
        raise SystemExit(f"unknown {what} {', '.join(unknown)}; known: {', '.join(allowed)}")
    return items


# ---- run ------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> None:
    if args.link != "loopback" and os.geteuid() != 0:
        raise SystemExit("bench/train.py: emulated links need root (network namespaces, tc)")
    overrides = {k: v for k, v in (("steps", args.steps), ("epochs", args.epochs),
                                   ("samples", args.samples), ("warmup_steps", args.warmup),
                                   ("evals_per_epoch", args.evals_per_epoch),
                                   ("seed", args.seed),
                                   ("windows_per_epoch", args.windows_per_epoch),
                                   ("optimizer", args.optimizer),
                                   ("outer_lr", args.outer_lr),
                                   ("outer_momentum", args.outer_momentum),
                                   ("diloco_warmup", args.diloco_warmup),
                                   ("warmup_codec", args.warmup_codec),
                                   ("sync_every", args.sync_every),
                                   ("lr_scale", args.lr_scale))
                 if v is not None}
    if args.lr_drops:
        overrides["lr_drops"] = tuple(int(e) for e in args.lr_drops.split(","))
    if args.dtype != "float32":
        overrides["dtype"] = args.dtype
    if args.results is None:
        args.results = "results/train" + ("" if args.dtype == "float32" else f"-{args.dtype}")
    todo = configs(_split(args.models, MODELS, "models"),
                   _split(args.methods, dict(METHODS), "methods"), overrides)
    started = time.perf_counter()
    for k, (model, name, config) in enumerate(todo, 1):
        link_dir = args.link if args.ranks_per_host == 1 else (
            f"{args.link}-{args.ranks // args.ranks_per_host}x{args.ranks_per_host}")
        directory = os.path.join(args.results, link_dir, model)
        out = os.path.join(directory, f"{name}.json")
        head = f"[{k}/{len(todo)}] {LINK_NAMES.get(args.link, args.link)} {model} {name}"
        if os.path.exists(out) and not args.force:
            print(f"{head}: done before, skipped ({out})", flush=True)
            continue
        os.makedirs(directory, exist_ok=True)
        print(f"{head}: {method_label(config)}", flush=True)
        partial = out + ".partial"
        try:
            result = launch(config, partial, ranks=args.ranks, link=args.link,
                            log=os.path.join(directory, f"{name}.log"), echo=args.verbose,
                            ranks_per_host=args.ranks_per_host)
        except RuntimeError as e:
            print(f"{head}: FAILED: {e}", file=sys.stderr, flush=True)
            if args.keep_going:
                continue
            raise SystemExit(1)
        result["name"] = name
        with open(partial, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(partial, out)  # a JSON exists only for a finished configuration
        accuracy = result["test_accuracy"]
        quality = (f"validation loss {result['val_loss']:.4f}" if result.get("task") == "lm"
                   else f"test accuracy {'-' if accuracy is None else f'{100 * accuracy:.2f} %'}")
        unit = "windows/s" if result.get("task") == "lm" else "samples/s"
        print(f"{head}: {result['samples_per_second']:,.0f} {unit}, "
              f"{_mb(result['wire_bytes_per_step'])} MB/step/rank on the wire, {quality}, "
              f"replicas {'identical' if result['replicas_identical'] else 'DIFFER'}, "
              f"{result['wall_seconds']:.0f} s", flush=True)
    print(f"bench/train.py: {args.link} finished in {time.perf_counter() - started:.0f} s",
          flush=True)


# ---- report ---------------------------------------------------------------------------------

def _mb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 1e6:.3g}"


def load(results: str) -> Dict[Tuple[str, str], Dict[str, Dict]]:
    """{(link, model): {method name: result}} of every finished configuration."""
    table: Dict[Tuple[str, str], Dict[str, Dict]] = {}
    for path in sorted(glob.glob(os.path.join(results, "*", "*", "*.json"))):
        with open(path) as f:
            r = json.load(f)
        link, model = path.split(os.sep)[-3:-1]
        if r.get("config") and not r["config"].get("label"):
            r["label"] = method_label(RunConfig(**r["config"]))  # today's naming, for old runs too
        table.setdefault((link, model), {})[r.get("name") or os.path.basename(path)[:-5]] = r
    return table


def _order(names: Iterable[str]) -> List[str]:
    known = [n for n, _ in METHODS]
    return sorted(names, key=lambda n: known.index(n) if n in known else len(known))


def _links(table) -> List[str]:
    present = {link for link, _ in table}
    return [l for l in (*LINKS, "loopback") if l in present] + sorted(
        present - set(LINKS) - {"loopback"})


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _seconds(s: Optional[float]) -> str:
    return "not reached" if s is None else f"{s:.0f}"


def time_to_accuracy(table, link: str, model: str, name: str) -> Tuple[Optional[float], bool]:
    """(seconds, estimated) until the run of `name` first reached its model's target accuracy.

    Measured where the run got there. A run cut short by --steps (the slow baselines at 100
    Mbit/s, whose full budget would take most of an hour) is estimated instead: the same method
    computes the same parameters step by step whatever the link (the same seeds, batches and
    reduction order; only codec=auto plans from the link, so it is never estimated), so it
    would reach the target at the step where its full run on another link did, and it takes
    that many steps at this link's median step time."""
    r = table[(link, model)][name]
    if r["time_to_accuracy"] is not None or not r.get("target_accuracy") or not _cut_short(r):
        return r["time_to_accuracy"], False
    full = _full_run(table, model, name)
    if full is not None:
        reached = [c for c in full["curve"] if c["accuracy"] >= r["target_accuracy"]]
        if reached:
            return reached[0]["step"] * r["median_step_seconds"], True
    return None, False


def _tta_text(table, link: str, model: str, name: str) -> str:
    seconds, estimated = time_to_accuracy(table, link, model, name)
    return _seconds(seconds) + (" (est.)" if estimated else "")


def _cut_short(r: Dict) -> bool:
    """Whether a run stopped at --steps before its model's budget of epochs."""
    return bool(r["steps_per_epoch"]) and r["steps"] < r["steps_per_epoch"] * r["config"]["epochs"]


def _full_run(table, model: str, name: str) -> Optional[Dict]:
    """The same method's run over the whole budget on some link, which a run cut short by
    --steps stands in for (the same parameters step by step; never codec=auto, which plans
    from the links)."""
    if "auto" in name:
        return None
    for link in _links(table):
        r = table.get((link, model), {}).get(name)
        if r is not None and not _cut_short(r):
            return r
    return None


def final_accuracy(table, link: str, model: str, name: str) -> Optional[float]:
    """Test accuracy after the model's whole budget: the run's own, or for a run cut short, that
    of the same method's full run on another link (the same parameters, see time_to_accuracy;
    never for codec=auto)."""
    r = table[(link, model)].get(name)
    if r is None:
        return None
    if not _cut_short(r):
        return r["test_accuracy"]
    full = _full_run(table, model, name)
    return None if full is None else full["test_accuracy"]


def _is_terse(name: str) -> bool:
    return name.startswith("terse-")


def best_terse(table, link: str, model: str, by: str) -> Optional[str]:
    """The terse configuration with the least time to accuracy (by="tta") or the most samples/s
    among those whose final test accuracy is within 0.5 points of DDP fp32 (by="throughput";
    any accuracy for synthetic data). Accuracies are after the whole budget (final_accuracy)."""
    runs = table[(link, model)]
    reference = final_accuracy(table, link, model, "ddp")
    candidates = []
    for name, r in runs.items():
        if not _is_terse(name):
            continue
        if by == "tta":
            seconds, _ = time_to_accuracy(table, link, model, name)
            if seconds is not None:
                candidates.append((seconds, name))
        else:
            accuracy = final_accuracy(table, link, model, name)
            if r.get("target_accuracy") is None or (
                    accuracy is not None and reference is not None
                    and accuracy >= reference - 0.005):
                candidates.append((-r["samples_per_second"], name))
    return min(candidates)[1] if candidates else None


def _loss_text(r: Dict) -> str:
    return "not reached" if r.get("time_to_loss") is None else (
        f"{r['time_to_loss']:.0f} ({r['steps_to_loss']})")


def time_to_loss(r: Dict, loss: float) -> Optional[Tuple[float, int]]:
    """(training seconds, step) of run r's first evaluation at or below ``loss``, or None."""
    reached = [c for c in r["curve"] if c.get("val_loss") is not None and c["val_loss"] <= loss]
    return (reached[0]["train_seconds"], reached[0]["step"]) if reached else None


def lm_table(table, link: str, model: str) -> List[str]:
    """The detailed table of the language model at one link rate: final validation loss and
    time to the target loss instead of accuracy; against the compute-only floor (when it ran),
    each method's time to the target over the floor's time for as many steps."""
    runs = table[(link, model)]
    any_run = next(iter(runs.values()))
    floor = runs.get("compute-only", {}).get("median_step_seconds")
    ddp = runs.get("ddp")
    lines = [
        f"#### {any_run['model_description']}, {LINK_NAMES.get(link, link)}", "",
        f"{any_run['ranks']} ranks, batch {any_run['batch_per_rank']} windows of "
        f"{any_run.get('context')} bytes per rank, {any_run.get('optimizer', 'sgd')} lr "
        f"{any_run['lr']}, {any_run['parameters']:,} parameters "
        f"({any_run['gradient_bytes'] / 1e6:.1f} MB fp32 gradient); {any_run['steps']} steps; "
        f"time to validation loss {any_run.get('target_loss')} nats/byte.", "",
        "| method | windows/s | step ms (fwd / bwd+comm / opt) | comm ms | wire MB/step "
        "| terse payload MB | val loss | vs DDP fp32 | time to target s (step) | x floor "
        "| replicas | others' CPU |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name in _order(runs):
        r = runs[name]
        step, local = r["median_step_seconds"], name in FLOORS
        parts = " / ".join(f"{1000 * r[k]:.0f}" for k in (
            "median_forward_seconds", "median_backward_seconds", "median_optimizer_seconds"))
        comm = f"{1000 * (step - floor):.0f}" if floor and name != "compute-only" else "-"
        loss = "-" if local or r.get("val_loss") is None else f"{r['val_loss']:.4f}"
        delta = ("-" if local or not ddp or r.get("val_loss") is None
                 else f"{r['val_loss'] - ddp['val_loss']:+.4f}")
        slow = ("-" if local or not floor or r.get("time_to_loss") is None
                else f"{r['time_to_loss'] / (r['steps_to_loss'] * floor):.2f}")
        machine = r.get("machine", {})
        others = (f"{100 * machine['cpu_seconds_others'] / machine['cpu_seconds_available']:.0f} %"
                  if machine.get("cpu_seconds_available") else "-")
        replicas = "n/a (floor)" if local else ("identical" if r["replicas_identical"]
                                                  else "**DIFFER**")
        lines.append(
            f"| {r['label']} | {r['samples_per_second']:,.1f} | {1000 * step:.0f} ({parts}) "
            f"| {comm} | {_mb(r['wire_bytes_per_step'])} | {_mb(r['payload_bytes_per_step'])} "
            f"| {loss} | {delta} | {'-' if local else _loss_text(r)} | {slow} | {replicas} "
            f"| {others} |")
    reached = time_to_loss(ddp, ddp["val_loss"]) if ddp and ddp.get("val_loss") else None
    if reached and floor:
        lines += ["", f"S = DDP fp32's time to its final validation loss ({ddp['val_loss']:.4f}): "
                  f"{reached[0]:.0f} s at step {reached[1]}, over the compute-only floor's "
                  f"{reached[1] * floor:.0f} s for as many steps: "
                  f"S = {reached[0] / (reached[1] * floor):.2f}."]
    return lines + diloco_table(table, link, model) + [""]


def diloco_table(table, link: str, model: str) -> List[str]:
    """DiLoCo's exchanges at one link rate (when a DiLoCo method ran): bytes on the wire over
    the whole run against DDP fp32's in the same invocation, and how much of the exchange time
    Streaming DiLoCo hid behind inner steps."""
    runs = table[(link, model)]
    names = [n for n in _order(runs) if runs[n]["config"]["method"] in DILOCO_METHODS]
    if not names:
        return []

    def run_bytes(r: Dict) -> Optional[float]:
        per_step = r.get("wire_bytes_per_step")
        return None if per_step is None else per_step * r["timed_steps"]

    ddp = runs.get("ddp")
    ddp_bytes = run_bytes(ddp) if ddp else None
    lines = ["", "| DiLoCo method | outer exchanges | wire MB over the run (rank mean) "
             "| fewer bytes than DDP fp32 | exchange s | waited s | hidden |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        r = runs[name]
        stats = r.get("diloco") or {}
        sent = run_bytes(r)

        def number(key: str) -> str:
            value = stats.get(key)
            return "-" if value is None else f"{value:.1f}"

        hidden = stats.get("hidden")
        lines.append(
            f"| {r['label']} | {stats.get('outer_steps', '-')} "
            f"| {'-' if sent is None else f'{sent / 1e6:.1f}'} "
            f"| {_ratio(ddp_bytes, sent)} | {number('exchange_seconds')} "
            f"| {number('waited_seconds')} "
            f"| {'-' if hidden is None else f'{100 * hidden:.0f} %'} |")
    return lines


def model_table(table, link: str, model: str) -> List[str]:
    """The detailed table of one model at one link rate."""
    if MODELS[model].task == "lm":
        return lm_table(table, link, model)
    runs = table[(link, model)]
    any_run = next(iter(runs.values()))
    ddp, fp16, psgd = (runs.get(n, {}).get("samples_per_second")
                       for n in ("ddp", "ddp-fp16", "ddp-powersgd-r4"))
    floor = runs.get("compute-only", {}).get("median_step_seconds")
    reference = final_accuracy(table, link, model, "ddp")
    target = any_run.get("target_accuracy")
    budget = (f"{any_run['config']['epochs']} epoch(s) of {any_run['train_samples']:,} images"
              if any_run["steps_per_epoch"] else f"{any_run['steps']} steps")
    lines = [
        f"#### {any_run['model_description']}, {LINK_NAMES.get(link, link)}",
        "",
        f"{any_run['ranks']} ranks, batch {any_run['batch_per_rank']} per rank, SGD lr "
        f"{any_run['lr']} momentum {any_run['momentum']}, {any_run['parameters']:,} parameters "
        f"({any_run['gradient_bytes'] / 1e6:.1f} MB fp32 gradient); {budget}"
        + (f"; time to {100 * target:.0f} % test accuracy" if target else "") + ".",
        "",
        "| method | samples/s | vs DDP fp32 | vs fp16 hook | vs PowerSGD r4 | step ms "
        "(fwd / bwd+comm / opt) | comm ms | wire MB/step | terse payload MB | test acc % "
        "| vs DDP fp32 (points) | time to target s | replicas | others' CPU |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name in _order(runs):
        r = runs[name]
        step = r["median_step_seconds"]
        parts = " / ".join(f"{1000 * r[k]:.0f}" for k in (
            "median_forward_seconds", "median_backward_seconds", "median_optimizer_seconds"))
        comm = f"{1000 * (step - floor):.0f}" if floor and name != "compute-only" else "-"
        accuracy = r["test_accuracy"]
        local = name in FLOORS
        acc = "-" if accuracy is None or local else f"{100 * accuracy:.2f}"
        final = final_accuracy(table, link, model, name)
        if _cut_short(r) and not local:
            # Cut short by --steps: its accuracy at that step, and after the whole budget the
            # full run's (the same parameters; see time_to_accuracy), in parentheses.
            acc = (f"{acc} at step {r['steps']}"
                   + ("" if final is None else f" ({100 * final:.2f})"))
        delta = ("-" if final is None or reference is None or local
                 else f"{100 * (final - reference):+.2f}")
        tta = "-" if target is None or local else _tta_text(table, link, model, name)
        replicas = "n/a (floor)" if local else ("identical" if r["replicas_identical"]
                                                  else "**DIFFER**")
        machine = r.get("machine", {})
        others = (f"{100 * machine['cpu_seconds_others'] / machine['cpu_seconds_available']:.0f} %"
                  if machine.get("cpu_seconds_available") else "-")
        rate = r["samples_per_second"]
        lines.append(
            f"| {r['label']} | {rate:,.0f} | {_ratio(rate, ddp)} | {_ratio(rate, fp16)} "
            f"| {_ratio(rate, psgd)} | {1000 * step:.0f} ({parts}) | {comm} "
            f"| {_mb(r['wire_bytes_per_step'])} | {_mb(r['payload_bytes_per_step'])} | {acc} "
            f"| {delta} | {tta} | {replicas} | {others} |")
    return lines + [""]


def summary_tables(table) -> List[str]:
    """Throughput and time to accuracy of every method across link rates, one table a model."""
    links = _links(table)
    models = [m for m in MODELS if any((l, m) in table for l in links)]
    lines = []
    for model in models:
        names = _order({n for l in links for n in table.get((l, model), {})})
        spec = MODELS[model]
        lines += [f"#### {spec.description}: samples/s (and time to "
                  f"{100 * spec.target_accuracy:.0f} % test accuracy, s)"
                  if spec.target_accuracy else
                  f"#### {spec.description}: windows/s (and time to validation loss "
                  f"{spec.target_loss} nats/byte, s (step))"
                  if spec.task == "lm" else f"#### {spec.description}: samples/s", "",
                  "| method | " + " | ".join(LINK_NAMES.get(l, l) for l in links) + " |",
                  "|---|" + "---:|" * len(links)]
        for name in names:
            cells = []
            for link in links:
                r = table.get((link, model), {}).get(name)
                if r is None:
                    cells.append("-")
                    continue
                cell = f"{r['samples_per_second']:,.{1 if spec.task == 'lm' else 0}f}"
                if spec.task == "lm" and name not in FLOORS:
                    cell += f" ({_loss_text(r)})"
                elif spec.target_accuracy and name not in FLOORS:
                    cell += f" ({_tta_text(table, link, model, name)})"
                cells.append(cell)
            label = next(r["label"] for l in links
                         for n, r in table.get((l, model), {}).items() if n == name)
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def targets(table) -> List[str]:
    """The issue's targets, each with the measured figures and whether it is met."""
    lines = ["| target | model, link | measured | met |", "|---|---|---|---|"]

    def row(target: str, where: str, measured: str, ok: Optional[bool]) -> None:
        lines.append(f"| {target} | {where} | {measured} | "
                     f"{'-' if ok is None else ('yes' if ok else '**no**')} |")

    for link in ("100mbit", "1gbit"):
        for model in MODELS:
            runs = table.get((link, model))
            if not runs or MODELS[model].task == "lm":  # the targets are the image models'
                continue
            where = f"{model}, {LINK_NAMES[link]}"
            base = {n: runs.get(n) for n in ("ddp", "ddp-fp16", "ddp-powersgd-r4")}
            if MODELS[model].target_accuracy:
                best = best_terse(table, link, model, "tta")
                if best and all(base.values()):
                    t, _ = time_to_accuracy(table, link, model, best)
                    # Every PyTorch peer that ran: fp32, the fp16 and bf16 hooks, PowerSGD.
                    names = list(base) + [n for n in runs
                                          if n.startswith("ddp-") and n not in base]
                    others = {n: time_to_accuracy(table, link, model, n) for n in names}
                    ok = all(o is None or t < o for o, _ in others.values())
                    row("time to accuracy: best terse sooner than every PyTorch peer (DDP "
                        "fp32, its fp16/bf16 hooks, its PowerSGD hooks)", where,
                        f"{runs[best]['label']} {_tta_text(table, link, model, best)} s; "
                        + ", ".join(f"{runs[n]['label']} {_tta_text(table, link, model, n)}"
                                    + (" s" if others[n][0] is not None else "")
                                    for n in names), ok)
                    final, reference = (final_accuracy(table, link, model, n)
                                        for n in (best, "ddp"))
                    if final is not None and reference is not None:
                        row("final accuracy of that configuration within 0.5 points of DDP "
                            "fp32", where, f"{100 * final:.2f} % against {100 * reference:.2f} %",
                            final >= reference - 0.005)
                else:
                    row("time to accuracy", where, "no terse configuration reached the target"
                        if not best else "a baseline is missing", False if not best else None)
            best = best_terse(table, link, model, "throughput")
            if best and base["ddp-fp16"] and base["ddp-powersgd-r4"]:
                rate = runs[best]["samples_per_second"]
                fp16 = base["ddp-fp16"]["samples_per_second"]
                psgd = base["ddp-powersgd-r4"]["samples_per_second"]
                row("throughput: best terse >= 1.5x fp16 hook and >= PowerSGD hook r4 "
                    "(accuracy within 0.5 points of DDP fp32)", where,
                    f"{runs[best]['label']} {rate:,.0f} samples/s = {rate / fp16:.2f}x fp16 "
                    f"hook, {rate / psgd:.2f}x PowerSGD r4", rate >= 1.5 * fp16 and rate >= psgd)
            elif MODELS[model].target_accuracy and base["ddp"]:
                row("throughput", where, "no terse configuration within 0.5 points of DDP fp32",
                    False)
            auto = runs.get("terse-auto")
            others = [n for n in runs if _is_terse(n) and "auto" not in n]
            # The fastest fixed terse configuration, whatever its accuracy (the stricter test).
            fastest = max(others, key=lambda n: runs[n]["samples_per_second"], default=None)
            if auto and fastest:
                ratio = auto["samples_per_second"] / runs[fastest]["samples_per_second"]
                row("codec=auto within 10% of the fastest terse configuration", where,
                    f"auto {auto['samples_per_second']:,.0f} samples/s = {ratio:.2f}x "
                    f"{runs[fastest]['label']}", ratio >= 0.9)
    for model in MODELS:
        runs = table.get(("unshaped", model))
        if runs and runs.get("terse-auto") and runs.get("ddp"):
            ratio = runs["terse-auto"]["samples_per_second"] / runs["ddp"]["samples_per_second"]
            row("codec=auto at most 5% slower than DDP fp32 (unshaped)", f"{model}, unshaped",
                f"{ratio:.3f}x DDP fp32", ratio >= 0.95)
    identical = [(l, m, n) for (l, m), runs in table.items() for n, r in runs.items()
                 if n not in FLOORS and not r["replicas_identical"]]
    total = sum(1 for runs in table.values() for n in runs if n not in FLOORS)
    row("parameters bit-identical across ranks after every run", "all",
        f"{total - len(identical)} of {total} runs"
        + (": differ in " + ", ".join("/".join(x) for x in identical) if identical else ""),
        not identical)
    return lines + [""]


def runtime(table) -> List[str]:
    """Wall time of the benchmark's runs (start-up included), per link and in total."""
    lines = []
    total = 0.0
    for link in _links(table):
        seconds = sum(r["wall_seconds"] for (l, _), runs in table.items() if l == link
                      for r in runs.values())
        runs = sum(len(runs) for (l, _), runs in table.items() if l == link)
        total += seconds
        lines.append(f"- {LINK_NAMES.get(link, link)}: {runs} runs, {seconds / 60:.0f} min")
    lines.append(f"- total: {total / 3600:.2f} h of wall time")
    return lines + [""]


def markdown(table) -> str:
    lines = ["### Summary", ""] + summary_tables(table)
    lines += ["### Targets", ""] + targets(table)
    lines += ["### Every configuration", ""]
    for link in _links(table):
        for model in MODELS:
            if (link, model) in table:
                lines += model_table(table, link, model)
    lines += ["### Runtime of the benchmark", ""] + runtime(table)
    return "\n".join(lines)


def _legend(axes) -> None:
    """One legend, right of the last panel, for the methods of every panel (a panel shows only
    the methods run on it)."""
    handles = {}
    for ax in axes:
        for h, l in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(l, h)
    axes[-1].legend(handles.values(), handles.keys(), fontsize=7, loc="center left",
                    bbox_to_anchor=(1.0, 0.5))


def curve_bytes(r: Dict) -> Optional[List[float]]:
    """Bytes one rank had sent at each evaluation of run r: counted on the interface (or by
    terse where the interface is not, e.g. over loopback); for runs that did not record them
    per evaluation, the run's mean per step times the steps after warm-up."""
    for key in ("wire_bytes", "payload_bytes"):
        if all(c.get(key) is not None for c in r["curve"]):
            return [float(c[key]) for c in r["curve"]]
    warmup = r["config"].get("warmup_steps", 0)
    for key in ("wire_bytes_per_step", "payload_bytes_per_step"):
        if r.get(key):
            return [r[key] * max(0, c["step"] - warmup) for c in r["curve"]]
    return None


def plots(table, directory: str, suffix: str = "") -> List[str]:
    """Throughput vs link rate (one panel a model) and, per Fashion-MNIST model, accuracy
    against training time (top row) and against bytes sent (bottom row), one column a link
    rate; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    written = []
    links = [l for l in _links(table) if l != "loopback"] or _links(table)
    models = [m for m in MODELS if any((l, m) in table for l in links)]
    names = _order({n for runs in table.values() for n in runs})
    styles = {n: ("--" if n in BASELINES else (":" if n in FLOORS else "-"))
              for n in names}
    colors = {n: plt.cm.tab20(i % 20) for i, n in enumerate(names)}

    def label_of(name: str) -> str:
        return next(r["label"] for runs in table.values() for n, r in runs.items() if n == name)

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for name in names:
            xs, ys = [], []
            for i, link in enumerate(links):
                r = table.get((link, model), {}).get(name)
                if r:
                    xs.append(i)
                    ys.append(r["samples_per_second"])
            if xs:
                ax.plot(xs, ys, styles[name], marker="o", color=colors[name],
                        label=label_of(name))
        ax.set_xticks(range(len(links)), [LINK_NAMES.get(l, l) for l in links])
        ax.set_yscale("log")
        ax.set_title(MODELS[model].description, fontsize=9)
        ax.set_xlabel("link rate")
        ax.set_ylabel("samples/s (median step, 4 ranks)")
        ax.grid(True, which="both", alpha=0.3)
    _legend(axes[0])
    fig.tight_layout()
    path = os.path.join(directory, f"training-throughput{suffix}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    for model in models:
        spec = MODELS[model]
        if spec.task == "lm":
            written.append(loss_plot(table, model, [l for l in links if (l, model) in table],
                                     names, styles, colors, directory, suffix))
            continue
        if not spec.target_accuracy:
            continue
        panels = [l for l in links if (l, model) in table]
        # Top row: accuracy against training time; bottom row: against bytes sent.
        # Room on the right for the legend.
        fig, axes = plt.subplots(2, len(panels), figsize=(6 * len(panels) + 4, 9.5),
                                 squeeze=False)
        for column, link in enumerate(panels):
            top, bottom = axes[0][column], axes[1][column]
            for name in names:
                r = table[(link, model)].get(name)
                if not r or name in FLOORS or not r["curve"]:
                    continue
                # The evaluations only (both axes are logarithmic: no point at zero).
                accuracy = [c["accuracy"] for c in r["curve"]]
                top.plot([c["train_seconds"] for c in r["curve"]], accuracy, styles[name],
                         marker=".", color=colors[name], label=label_of(name))
                sent = curve_bytes(r)
                if sent:
                    bottom.plot(sent, accuracy, styles[name], marker=".", color=colors[name],
                                label=label_of(name))
            title = f"{spec.description}, {LINK_NAMES.get(link, link)}"
            top.set_xscale("log")  # runs differ by 10x and more in speed
            top.set_xlabel("training time, s (evaluation excluded; log scale)")
            bottom.set_xscale("log")  # and by 100x and more in bytes
            bottom.set_xlabel("bytes sent per rank (log scale)")
            for ax in (top, bottom):
                ax.axhline(spec.target_accuracy, color="gray", lw=0.8)
                ax.set_ylim(max(0.0, spec.target_accuracy - 0.15), 1.0)
                ax.set_title(title, fontsize=9)
                ax.set_ylabel("test accuracy")
                ax.grid(True, which="both", alpha=0.3)
        _legend(axes[0])
        _legend(axes[1])
        fig.tight_layout()
        path = os.path.join(directory, f"training-accuracy-{model}{suffix}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def loss_plot(table, model: str, links: List[str], names: List[str], styles: Dict,
              colors: Dict, directory: str, suffix: str) -> str:
    """The language model's validation loss against training time (top row) and against bytes
    sent (bottom row), one column a link rate; returns the file written."""
    import matplotlib.pyplot as plt

    spec = MODELS[model]
    fig, axes = plt.subplots(2, len(links), figsize=(6 * len(links) + 4, 9.5), squeeze=False)
    for column, link in enumerate(links):
        top, bottom = axes[0][column], axes[1][column]
        for name in names:
            r = table[(link, model)].get(name)
            if not r or name in FLOORS or not r["curve"]:
                continue
            loss = [c["val_loss"] for c in r["curve"]]
            top.plot([c["train_seconds"] for c in r["curve"]], loss, styles[name], marker=".",
                     color=colors[name], label=r["label"])
            sent = curve_bytes(r)
            if sent:
                # No point at zero bytes on the logarithmic axis (DiLoCo before its first
                # outer step).
                points = [(b, v) for b, v in zip(sent, loss) if b > 0]
                bottom.plot([b for b, _ in points], [v for _, v in points], styles[name],
                            marker=".", color=colors[name], label=r["label"])
        top.set_xlabel("training time, s (evaluation excluded)")
        bottom.set_xscale("log")  # methods differ by 1000x and more in bytes
        bottom.set_xlabel("bytes sent per rank (log scale)")
        for ax in (top, bottom):
            if spec.target_loss:
                ax.axhline(spec.target_loss, color="gray", lw=0.8)
            ax.set_title(f"{spec.description}, {LINK_NAMES.get(link, link)}", fontsize=9)
            ax.set_ylabel("validation loss, nats per byte")
            ax.grid(True, which="both", alpha=0.3)
    _legend(axes[0])
    _legend(axes[1])
    fig.tight_layout()
    path = os.path.join(directory, f"training-loss-{model}{suffix}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markers(section: str) -> Tuple[str, str]:
    """The comments around a report's part of a page: one pair per --section."""
    name = f"training-report-{section}" if section else "training-report"
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def report(args: argparse.Namespace) -> None:
    begin, end = markers(args.section)
    table = load(args.results)
    if not table:
        raise SystemExit(f"bench/train.py: no results under {args.results}")
    text = markdown(table)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.update:
        with open(args.update) as f:
            page = f.read()
        if begin not in page or end not in page:
            raise SystemExit(f"{args.update} has no {begin} ... {end} markers")
        head, rest = page.split(begin, 1)
        tail = rest.split(end, 1)[1]
        with open(args.update, "w") as f:
            f.write(f"{head}{begin}\n{text}\n{end}{tail}")
    if args.plots:
        for path in plots(table, args.plots, f"-{args.section}" if args.section else ""):
            print(f"plot: {path}", file=sys.stderr)


def list_matrix(args: argparse.Namespace) -> None:
    for model, name, config in configs(MODELS, dict(METHODS), {}):
        budget = (f"{config.steps} steps" if config.steps
                  else f"{config.epochs} epoch(s), accuracy {config.evals_per_epoch}x/epoch")
        print(f"{model:4} {name:18} {method_label(config):34} {budget}")


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="bench/train.py",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train every selected configuration at one link rate")
    r.add_argument("--link", required=True,
                   help="unshaped, 1gbit, 100mbit (any tc rate), or loopback (no emulation)")
    r.add_argument("--models", "--model", dest="models", default=",".join(DEFAULT_MODELS),
                   help=f"models, comma-separated (default {','.join(DEFAULT_MODELS)}; "
                        f"known: {','.join(MODELS)})")
    r.add_argument("--methods", default=",".join(n for n, _ in METHODS))
    r.add_argument("--results", help="default: results/train, or results/train-DTYPE")
    r.add_argument("--ranks", type=int, default=4)
    r.add_argument("--ranks-per-host", type=int, default=1,
                   help="hosts of this many consecutive ranks (emulated: cluster.sh -l; "
                        "loopback: TERSE_TOPOLOGY); results under LINK-HxR/")
    r.add_argument("--force", action="store_true", help="run configurations that have a JSON")
    r.add_argument("--keep-going", action="store_true", help="go on after a failed run")
    r.add_argument("--verbose", action="store_true", help="show rank 0's output")
    r.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the model's dtype (model.to(dtype)): its gradients and DDP's buckets; "
                        "results default to results/train-DTYPE, so that report compares "
                        "the methods at one dtype")
    r.add_argument("--steps", type=int, help="override: train this many steps")
    r.add_argument("--epochs", type=int, help="override: epochs")
    r.add_argument("--samples", type=int, help="override: training images used")
    r.add_argument("--warmup", type=int, help="override: steps left out of the median")
    r.add_argument("--evals-per-epoch", type=int, help="override: accuracy checks per epoch")
    r.add_argument("--lr-drops", help="override: epochs (from 0) at whose start the learning "
                   "rate drops 10x, e.g. 4 or 3,5")
    r.add_argument("--windows-per-epoch", type=int,
                   help="override: Accordion's and the warm-up's windows per epoch (0: epochs)")
    r.add_argument("--optimizer", choices=("sgd", "adamw"),
                   help="override: the optimizer (default: the model's, adamw for gpt, sgd "
                        "for the others)")
    r.add_argument("--outer-lr", type=float, help="override: DiLoCo's outer Nesterov lr (0.7)")
    r.add_argument("--outer-momentum", type=float,
                   help="override: DiLoCo's outer Nesterov momentum (0.9)")
    r.add_argument("--diloco-warmup", type=float,
                   help="override: DiLoCo's share of the steps trained synchronously first (0)")
    r.add_argument("--warmup-codec", help="override: the codec of DiLoCo's warm-up (none)")
    r.add_argument("--sync-every", type=int, help="override: DiLoCo's H")
    r.add_argument("--lr-scale", type=float, help="override: AdamW's learning rate times this")
    r.add_argument("--seed", type=int,
                   help="initial weights and batch order (default 0); a run per seed, e.g. "
                        "--results results/train-seed1")
    r.set_defaults(func=run)
    q = sub.add_parser("report", help="tables, targets and plots from the JSON files")
    q.add_argument("--results", default="results/train")
    q.add_argument("--markdown", help="also write the tables to this file")
    q.add_argument("--update", help="replace the marked part of this markdown file")
    q.add_argument("--plots", help="directory for the PNG plots")
    q.add_argument("--section", default="",
                   help="a named report: its own markers (<!-- training-report-NAME:begin -->) "
                        "and plot names (training-accuracy-mlp-NAME.png)")
    q.set_defaults(func=report)
    sub.add_parser("list", help="the matrix").set_defaults(func=list_matrix)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
