"""Data-parallel training of the zoo's models (terse_harness.models): the training benchmark's
workloads and methods (bench/train.py, tests/python/test_train_bench.py).

A run is described by a :class:`RunConfig`: which model (and with it the data set, batch size
and optimizer), how gradients travel between the ranks (DDP's own allreduce, one of PyTorch's
communication hooks, or the terse hook with a codec), how long to train and how often to
measure test accuracy. :func:`launch` starts the run's ranks through the harness's launcher
(terse_harness.launch: over loopback with ``terse run`` or each on its own emulated host with
scripts/cluster.sh) and returns rank 0's result; every rank runs
``python3 -m terse_harness.training --config JSON --out FILE``.

What a run measures (the result's keys are described in :func:`run_rank`):

* time of every step, split into forward, backward (which includes waiting for DDP's
  communication) and optimizer step; throughput is the global batch over the median step time
  after ``warmup_steps``;
* test accuracy at fixed points (``evals_per_epoch``), each stamped with the training time so
  far (for the language model, gpt: validation loss in nats per byte, terse_harness.lm); evaluation itself is not training time, for every method alike, so time-to-accuracy is
  the training clock at the first evaluation that reaches the model's target;
* bytes each rank sent per step: on an emulated host from the kernel's counters of its
  interface (``/proc/self/net/dev``; what any method puts on the wire, TCP/IP headers
  included), and for the terse hook also the engine's own count of payload bytes;
* a SHA-256 digest of every rank's parameters at the end, gathered on rank 0.
"""

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import resource
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

from terse.demo import interface_tx_bytes  # the demo's, also this module's for bench/moe.py
from terse_harness import launch as launcher, lm, models

# ---- models ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model of the zoo (terse_harness.models, by the same name) with its data set and the
    optimizer settings every method trains it with."""

    name: str
    description: str
    # "fashion-mnist", "synthetic" (throughput only: no accuracy) or "text" (the language
    # model's bytes, terse_harness.lm)
    dataset: str
    batch: int  # per rank (windows of ``context`` bytes for the language model)
    lr: float  # SGD's
    momentum: float
    target_accuracy: Optional[float]  # the time-to-accuracy level; None for synthetic data
    task: str = "classify"  # or "lm": next-byte prediction, validation loss instead of accuracy
    context: int = 0  # the language model's context, bytes
    optimizer: str = "sgd"  # the default optimizer: "sgd" or "adamw"
    adamw_lr: float = 1e-3  # AdamW's settings (its schedule: terse_harness.lm.schedule)
    betas: Tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    eps: float = 1e-8
    # The time-to-loss level: validation loss, nats per byte (the language model's)
    target_loss: Optional[float] = None


MODELS: Dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", "MLP 784-2048-2048-10 on Fashion-MNIST", "fashion-mnist",
                     batch=64, lr=0.05, momentum=0.9, target_accuracy=0.85),
    "cnn": ModelSpec("cnn", "CNN conv32-conv64-fc128 on Fashion-MNIST", "fashion-mnist",
                     batch=64, lr=0.05, momentum=0.9, target_accuracy=0.88),
    "transformer": ModelSpec("transformer", "patch transformer (4 layers, width 128) on "
                             "Fashion-MNIST", "fashion-mnist", batch=64, lr=0.05, momentum=0.9,
                             target_accuracy=0.82),
    "vgg-small": ModelSpec("vgg-small", "VGG-style CNN (conv 32-64-128, fc 2560x3) on "
                           "synthetic 3x32x32 images", "synthetic", batch=32, lr=0.01,
                           momentum=0.9, target_accuracy=None),
    # SGD's lr for gpt is untuned: AdamW is its optimizer.
    "gpt": ModelSpec("gpt", "byte-level GPT (4 blocks, width 256, context 128) on Debian's "
                     "fortunes", "text", batch=4, lr=0.1, momentum=0.9, target_accuracy=None,
                     task="lm", context=128, optimizer="adamw", target_loss=2.65),
}


def build_model(name: str, seed: int = 0):
    """The model ``name`` with the same initial weights on every rank (for a given seed)."""
    import torch

    torch.manual_seed(seed)
    return models.build(MODELS[name].name)


# ---- how gradients travel -------------------------------------------------------------------

METHODS = ("ddp", "ddp-fp16", "ddp-bf16", "ddp-powersgd", "ddp-powersgd-batched", "terse",
           "local", "sync", "fsdp", "fsdp-bf16", "fsdp-terse", "ddp-terse-backend", "diloco",
           "torchft-diloco")
FSDP_METHODS = ("fsdp", "fsdp-bf16", "fsdp-terse")
# Infrequent synchronization: each rank trains alone (DDP with the floor's hook) and an outer
# loop around its optimizer averages the pseudo-gradients every sync_every steps.
DILOCO_METHODS = ("diloco", "torchft-diloco")


DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZERS = ("sgd", "adamw", "onebit-adam", "zeroone-adam")
# terse.optim's optimizers communicate themselves (under DDP through their own hook): method
# "ddp" only. They freeze the variance after this fraction of the run (the 1-bit Adam paper
# freezes after 15-25 % of training), with AdamW's settings and schedule otherwise.
COMMUNICATING_OPTIMIZERS = ("onebit-adam", "zeroone-adam")


@dataclasses.dataclass
class RunConfig:
    """One training run, the same on every rank.

    method: ``ddp`` (DistributedDataParallel's fp32 allreduce over Gloo), ``ddp-fp16``
    (PyTorch's fp16_compress_hook), ``ddp-bf16`` (its bf16_compress_hook; torch 2.x),
    ``ddp-powersgd`` (PyTorch's powerSGD_hook of rank ``powersgd_rank`` with error feedback and
    warm start), ``ddp-powersgd-batched`` (its batched_powerSGD_hook: one matrix per bucket;
    it fails on its first compressed step in torch 1.13 and 2.15.0), ``terse`` (terse's hook with
    ``codec``, ``strategy``, ``partitions``, ``min_bytes``; with codec ``auto`` or
    ``auto:heavy`` (or Accordion over them), ``auto_codecs`` and ``heavy_codecs``; with ``accordion`` (heavy, light), terse.Accordion's two levels instead of
    ``codec``; with ``sparse_warmup`` stages, terse.SparseWarmup of ``codec``; both count
    windows of 1/``windows_per_epoch`` epoch, or epochs when it is 0; ``clip_norm``: the
    hook's local gradient clipping), ``fsdp`` (FSDP2's ``fully_shard`` per layer with its
    default fp32 collectives over Gloo), ``fsdp-bf16`` (the same, gradients reduce-scattered in
    bfloat16: ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``), ``fsdp-terse`` (the same
    sharding with terse's reduce-scatter of ``codec`` and, with ``all_gather_codec``, its
    quantized parameter all-gather; ``min_bytes`` as for the hook), ``ddp-terse-backend`` (DDP
    without a hook on the process group backend ``cpu:terse``, which compresses float tensors
    of at least ``min_bytes`` with ``codec``), ``local`` (a hook that returns
    each rank's own gradient without communicating: the compute-only floor of a step; replicas
    diverge by design), ``sync`` (as ``local``, after an allreduce of one float per bucket
    through the default process group: the floor of a step whose ranks keep in step bucket by
    bucket but send next to nothing; replicas diverge), ``diloco`` (each rank trains alone as
    ``local`` does, and terse.diloco.DiLoCo around its optimizer averages the pseudo-gradients
    every ``sync_every`` steps, compressed with ``codec``, in ``fragments`` with Streaming
    DiLoCo's ``delay`` and ``mixing``, the outer Nesterov SGD of ``outer_lr`` and
    ``outer_momentum``; accuracy, loss and the digests are the global parameters'), or
    ``torchft-diloco`` (the same with torchft's DiLoCo, uncompressed).
    """

    model: str = "mlp"
    method: str = "ddp"
    codec: str = "powersgd"
    strategy: str = "auto"
    partitions: int = 0
    min_bytes: int = 64 << 10
    gather_bytes: int = 16 << 10  # the hook's gather_bytes: raw messages gathered up to this
    powersgd_rank: int = 4
    auto_codecs: Tuple[str, ...] = ()  # codec "auto": what the planner may choose (): default
    heavy_codecs: Tuple[str, ...] = ()  # codec "auto:heavy": what it adds (): default
    adaptive: bool = False  # the hook's adaptive=True: codec "auto"'s tiers for Adam
    all_gather_codec: str = ""  # fsdp-terse: the parameters' all-gather codec ("": raw)
    topology: str = ""  # TERSE_TOPOLOGY for terse's engines ("": the environment's, else auto)
    # fsdp-terse on hosts of several ranks (docs/topology.md): "auto", "flat" or "hosts"; and
    # hpZ, FSDP2's reshard_after_forward to the ranks of a host (terse.fsdp.ranks_per_host), so
    # that the backward's all-gathers stay inside each host.
    hierarchy: str = "auto"
    hpz: bool = False
    threads: int = 0  # terse engine worker threads per rank (0: the hook's default, 4)
    # DDP's bucket_cap_mb (0: DDP's default, 25): smaller buckets reach the hook earlier in the
    # backward pass, so more of their exchange overlaps it.
    bucket_mb: float = 0.0
    # The optimizer's momentum; < 0: the model's (0.9). A codec that carries the momentum in
    # what it sends (DGC's momentum correction) needs 0 here, or the step applies it twice.
    momentum: float = -1.0
    # Schedules of the terse hook's codec (terse.accordion): Accordion's (heavy, light) levels,
    # or a sparsifier's warm-up over this many windows; their window is 1/windows_per_epoch of
    # an epoch (0: an epoch, ended by the hook's epoch_end()).
    accordion: Tuple[str, ...] = ()
    accordion_eta: float = 0.5
    sparse_warmup: int = 0
    windows_per_epoch: int = 0
    clip_norm: float = 0.0  # the hook's local gradient clipping (0: off)
    epochs: int = 1
    # Epochs (counted from 0) at whose start the learning rate is multiplied by lr_drop_factor:
    # a step schedule. The terse hook watches the optimizer (Accordion's drop detection).
    lr_drops: Tuple[int, ...] = ()
    lr_drop_factor: float = 0.1
    samples: int = 60000  # training images used (Fashion-MNIST; not the LM's: it has no epochs)
    steps: int = 0  # > 0: stop after this many steps (the only limit for synthetic data)
    warmup_steps: int = 5  # excluded from the throughput median
    # Test accuracy this often per epoch, always once at the end; for the language model
    # (no epochs) validation loss this often per run, evenly spaced, and at the end.
    evals_per_epoch: int = 0
    timeout: float = 120.0  # seconds every terse wait is bounded by
    label: str = ""
    # Initial weights and the order of the batches (0: the benchmark's published runs).
    seed: int = 0
    progress_every: int = 0  # rank 0 prints a progress line every this many steps (0: 10x)
    # The model's parameters, and with them its gradients and DDP's buckets: float32, or
    # bfloat16 / float16 (the model cast with model.to(dtype), inputs cast to match).
    dtype: str = "float32"
    # "sgd" (with ``momentum``), "adamw" (terse_harness.lm.adamw: warm-up and cosine decay over
    # the run's steps), or "": the model's default (adamw for gpt, sgd for the others).
    optimizer: str = ""
    # DiLoCo (DILOCO_METHODS): H, the fragments, Streaming DiLoCo's delay (tau) and mixing
    # (alpha), and the outer Nesterov SGD.
    sync_every: int = 50
    fragments: int = 1
    delay: int = 0
    mixing: float = 0.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # The share of the run's steps trained synchronously before DiLoCo begins (DiLoCo's
    # warmup): gradients averaged every step with ``warmup_codec``.
    diloco_warmup: float = 0.0
    warmup_codec: str = "none"
    # AdamW's learning rate times this (1: the model's).
    lr_scale: float = 1.0
    # terse.optim (COMMUNICATING_OPTIMIZERS): the share of the steps before the variance freezes
    # (1-bit Adam's freeze_step, 0/1 Adam's var_freeze_step) and the momentum exchange's codec.
    freeze_fraction: float = 0.2
    optimizer_codec: str = "onebit:ef=1"
    precondition: bool = True  # False: the momentum is compressed as DeepSpeed does

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; known: {', '.join(MODELS)}")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; known: {', '.join(METHODS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPES)}")
        if MODELS[self.model].dataset == "synthetic" and self.steps <= 0:
            raise ValueError(f"model {self.model} trains on synthetic data: give steps > 0")
        if MODELS[self.model].task == "lm" and self.steps <= 0:
            raise ValueError(f"model {self.model} is a language model without epochs: give "
                             "steps > 0")
        if self.optimizer not in ("",) + OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; known: "
                             f"{', '.join(OPTIMIZERS)} ('': the model's default)")
        if self.optimizer in COMMUNICATING_OPTIMIZERS and self.method != "ddp":
            raise ValueError(f"optimizer {self.optimizer} communicates itself: use it with "
                             f"method ddp, not {self.method}")
        if self.lr_drops and self.optimizer_name() != "sgd":
            raise ValueError("lr_drops are SGD's step schedule; AdamW follows its own "
                             "(warm-up, cosine decay)")

    def optimizer_name(self) -> str:
        """The optimizer this run trains with: ``optimizer``, else the model's default."""
        return self.optimizer or MODELS[self.model].optimizer


def _local_hook():
    """A hook that returns each bucket unchanged: no communication at all (the compute-only
    floor). Built on first use: DDP checks the annotations, which need torch."""
    import torch
    import torch.distributed as dist

    def local(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    return local


def _sync_hook():
    """A hook that allreduces one float per bucket through the default process group and then
    returns the bucket unchanged: the ranks wait for each other as with any allreduce, but no
    gradient bytes move (the synchronization floor)."""
    import torch
    import torch.distributed as dist

    def sync(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        token = torch.zeros(1, dtype=bucket.buffer().dtype)
        future = dist.all_reduce(token, async_op=True).get_future()
        return future.then(lambda _: bucket.buffer())

    return sync


def _communication(model: Any, config: RunConfig, steps_per_epoch: int = 0) -> Optional[Any]:
    """Registers the communication hook of ``config.method`` on the DDP ``model``; returns the
    terse hook state for method ``terse`` (else None). ``steps_per_epoch`` sizes a codec
    schedule's windows (0: synthetic data, whose epoch is the whole run)."""
    if config.method == "ddp":
        return None
    if config.method in DILOCO_METHODS:
        model.register_comm_hook(None, _local_hook())  # DiLoCo's outer loop communicates
        return None
    if config.method == "ddp-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif config.method == "ddp-bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif config.method in ("ddp-powersgd", "ddp-powersgd-batched"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        # start_powerSGD_iter=2 is the earliest PyTorch allows with error feedback or warm start
        # (DDP rebuilds its buckets after the first step); before it the hook allreduces fp32.
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=config.powersgd_rank,
            use_error_feedback=True, warm_start=True, start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook
                                 if config.method == "ddp-powersgd"
                                 else powerSGD_hook.batched_powerSGD_hook)
    elif config.method == "local":
        model.register_comm_hook(None, _local_hook())
    elif config.method == "sync":
        model.register_comm_hook(None, _sync_hook())
    elif config.method == "terse":
        import terse.torch

        codec: Any = config.codec
        window = None
        if config.windows_per_epoch > 0:
            epoch = steps_per_epoch or config.steps
            window = max(1, epoch // config.windows_per_epoch)
        if config.accordion:
            codec = terse.Accordion(*config.accordion, eta=config.accordion_eta,
                                    window_steps=window)
        elif config.sparse_warmup > 0:
            codec = terse.SparseWarmup(config.codec, stages=config.sparse_warmup,
                                       window_steps=window)
        # Codec "auto"'s tiers, alone or as Accordion's levels: the planner decides.
        planned = any(c in ("auto", "auto:heavy")
                      for c in (config.accordion or (config.codec,)))
        state, hook = terse.torch.ddp_hook(
            model, codec=codec, strategy=config.strategy, partitions=config.partitions,
            min_bytes=config.min_bytes, gather_bytes=config.gather_bytes,
            threads=config.threads, timeout=config.timeout, seed=config.seed,
            clip_norm=config.clip_norm if config.clip_norm > 0 else None,
            auto_codecs=list(config.auto_codecs) if planned else None,
            heavy_codecs=list(config.heavy_codecs) if planned else None,
            adaptive=config.adaptive)
        model.register_comm_hook(state, hook)
        return state
    return None


def _shard_units(model: Any) -> List[Any]:
    """The modules FSDP shards one at a time: the model's children that hold parameters (the
    elements of a ModuleList each on their own); what is left belongs to the root."""
    import torch.nn as nn

    units = []
    for child in model.children():
        for module in (child if isinstance(child, nn.ModuleList) else [child]):
            if any(True for _ in module.parameters()):
                units.append(module)
    return units


def _fsdp_model(config: RunConfig) -> Any:
    """The model of ``config`` sharded with FSDP2's ``fully_shard`` per unit, then the root."""
    import torch

    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        raise RuntimeError(f"method {config.method} needs FSDP2's fully_shard (torch 2.6 or "
                           f"later); this is torch {torch.__version__}") from None
    model = build_model(config.model, config.seed).to(getattr(torch, config.dtype))
    policy = (MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if config.method == "fsdp-bf16"
              else MixedPrecisionPolicy())
    reshard: Any = True
    if config.hpz:
        import terse.fsdp
        reshard = terse.fsdp.ranks_per_host()
        if reshard is None:
            raise RuntimeError("hpz needs hosts of several ranks each, of one size "
                               "(TERSE_TOPOLOGY, or --ranks-per-host)")
    for unit in _shard_units(model):
        fully_shard(unit, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=policy)
    return model


def _fsdp_communication(model: Any, config: RunConfig) -> Optional[Any]:
    """Installs terse's collectives on the FSDP ``model`` for method ``fsdp-terse``; returns
    their state (else None)."""
    if config.method != "fsdp-terse":
        return None
    import terse.fsdp

    return terse.fsdp.compress(model, codec=config.codec,
                               all_gather_codec=config.all_gather_codec or None,
                               min_bytes=config.min_bytes, timeout=config.timeout,
                               hierarchy=config.hierarchy)


def _unwrapped(model: Any) -> Any:
    """The module itself: DDP's wrapped module, or an FSDP model (sharded in place)."""
    return getattr(model, "module", model)


def method_label(config: RunConfig) -> str:
    """How the method reads in tables: "DDP fp32", "DDP PowerSGD r4", "terse fp16", ...; an
    optimizer other than the model's default adds its name ("DDP fp32 [adamw]"), a model in
    bfloat16 or float16 its dtype: "DDP fp32 [bfloat16 model]". The momentum in a label is
    SGD's (AdamW has none)."""
    label = _method_label(config)
    if config.topology:  # terse's hosts as set for the run (docs/topology.md)
        label += " (flat)" if config.topology == "flat" else f" (hosts {config.topology})"
    if config.bucket_mb > 0:
        label += f" ({config.bucket_mb:g} MB buckets)"
    if config.optimizer in COMMUNICATING_OPTIMIZERS:
        label = {"onebit-adam": "terse 1-bit Adam", "zeroone-adam": "terse 0/1 Adam"}[
            config.optimizer]
        label += f" (freeze {round(100 * config.freeze_fraction)} %"
        label += "" if config.optimizer_codec == "onebit:ef=1" else f", {config.optimizer_codec}"
        label += ")" if config.precondition else ", as DeepSpeed)"
    elif config.optimizer and config.optimizer != MODELS[config.model].optimizer:
        label += f" [{config.optimizer}]"  # not the model's default optimizer
    return label if config.dtype == "float32" else f"{label} [{config.dtype} model]"


def _method_label(config: RunConfig) -> str:
    if config.method == "ddp":
        plain = "" if config.momentum < 0 else f" (SGD momentum {config.momentum:g})"
        return "DDP fp32" + plain
    if config.method == "ddp-fp16":
        return "DDP fp16 hook"
    if config.method == "ddp-bf16":
        return "DDP bf16 hook"
    if config.method == "ddp-powersgd":
        return f"DDP PowerSGD r{config.powersgd_rank}"
    if config.method == "ddp-powersgd-batched":
        return f"DDP batched PowerSGD r{config.powersgd_rank}"
    if config.method == "local":
        return "compute only (no communication)"
    if config.method == "sync":
        return "sync only (1 float per bucket)"
    if config.method == "ddp-terse-backend":
        return f"DDP on backend terse ({config.codec})"
    if config.method == "fsdp":
        return "FSDP fp32"
    if config.method == "fsdp-bf16":
        return "FSDP bf16 reduce"
    if config.method in DILOCO_METHODS:
        who = "torchft DiLoCo" if config.method == "torchft-diloco" else (
            "terse Streaming DiLoCo" if config.fragments > 1 or config.delay > 0
            else "terse DiLoCo")
        extra = [f"H={config.sync_every}"]
        extra += [] if config.method == "torchft-diloco" else [_codec_label(config.codec)]
        extra += [] if config.fragments == 1 else [f"{config.fragments} fragments"]
        extra += [] if config.delay == 0 else [f"tau={config.delay}"]
        extra += [] if config.mixing == 0 else [f"alpha={config.mixing:g}"]
        extra += [] if (config.outer_lr, config.outer_momentum) == (0.7, 0.9) else [
            f"outer lr {config.outer_lr:g} momentum {config.outer_momentum:g}"]
        extra += [] if config.diloco_warmup == 0 else [
            f"{config.diloco_warmup:.0%} synchronous ({_codec_label(config.warmup_codec)})"]
        return f"{who} ({', '.join(extra)})"
    extra = [] if config.strategy == "auto" else [config.strategy]
    extra += [] if config.partitions == 0 else [f"K={config.partitions}"]
    codec = _codec_label(config.codec)
    if config.accordion:
        codec = "Accordion " + " / ".join(_codec_label(c) for c in config.accordion)
        extra += [] if config.accordion_eta == 0.5 else [f"eta {config.accordion_eta:g}"]
    elif config.sparse_warmup > 0:
        codec += f" warm-up {config.sparse_warmup}"
    if config.accordion or config.sparse_warmup > 0:
        extra += [f"{config.windows_per_epoch} windows/epoch" if config.windows_per_epoch
                  else "epoch windows"]
    if (any(c in ("auto", "auto:heavy") for c in (config.accordion or (config.codec,)))
            and not config.auto_codecs and not config.heavy_codecs):
        extra += ["Adam tiers" if config.adaptive else "default tiers"]
    extra += [] if config.clip_norm <= 0 else [f"clip {config.clip_norm:g}"]
    extra += [] if config.momentum < 0 else [f"SGD momentum {config.momentum:g}"]
    if config.method == "fsdp-terse":
        extra += [] if not config.all_gather_codec else [f"all-gather {config.all_gather_codec}"]
        extra += [] if config.hierarchy == "auto" else [f"hierarchy {config.hierarchy}"]
        extra += ["hpZ"] if config.hpz else []
        return f"FSDP terse {codec}" + (f" ({', '.join(extra)})" if extra else "")
    return f"terse {codec}" + (f" ({', '.join(extra)})" if extra else "")


def _codec_label(codec: str) -> str:
    name, _, params = codec.partition(":")
    if name == "powersgd":  # named as PyTorch's hook is: "PowerSGD r4"
        keys = dict(kv.split("=", 1) for kv in params.split(",") if "=" in kv)
        rest = [f"{k}={v}" for k, v in keys.items() if k != "rank"]
        return f"PowerSGD r{keys.get('rank', 4)}" + (f" {','.join(rest)}" if rest else "")
    return codec


# ---- data -----------------------------------------------------------------------------------


class _Data:
    """Training and test sets of a model: Fashion-MNIST, or fixed random synthetic batches."""

    def __init__(self, spec: ModelSpec, config: RunConfig, rank: int, world: int) -> None:
        import torch

        self.rank, self.world, self.batch = rank, world, spec.batch
        self.seed = config.seed
        self.synthetic = spec.dataset == "synthetic"
        if self.synthetic:
            # A pool of 8 batches per rank, drawn once: generating images is no part of a step.
            g = torch.Generator().manual_seed(1000 + rank)
            self.pool = [(torch.randn(spec.batch, 3, 32, 32, generator=g),
                          torch.randint(0, 10, (spec.batch,), generator=g)) for _ in range(8)]
            self.train_size = 0
            self.x_test = self.y_test = None
            return
        from terse_harness.data import load_fashion_mnist

        x, y = load_fashion_mnist("train", limit=config.samples)
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)
        xt, yt = load_fashion_mnist("test")
        self.x_test, self.y_test = torch.from_numpy(xt), torch.from_numpy(yt)
        self.train_size = len(self.x)
        self.order = None

    @property
    def steps_per_epoch(self) -> int:
        return self.train_size // (self.batch * self.world) if not self.synthetic else 0

    def start_epoch(self, epoch: int) -> None:
        import torch

        if not self.synthetic:
            # The same permutation on every rank; each takes its slice of every global batch.
            self.order = torch.randperm(self.train_size,
                                        generator=torch.Generator().manual_seed(
                                            epoch + 1000003 * self.seed))

    def batch_of_step(self, i: int) -> Tuple[Any, Any]:
        """This rank's batch of the epoch's step i."""
        if self.synthetic:
            return self.pool[i % len(self.pool)]
        global_batch = self.batch * self.world
        start = i * global_batch + self.rank * self.batch
        index = self.order[start:start + self.batch]
        return self.x[index], self.y[index]


def evaluate(module: Any, data: _Data) -> float:
    """Test accuracy over all 10,000 test images: each rank scores every world-th one, and the
    counts are summed over the default process group."""
    import torch
    import torch.distributed as dist

    module.eval()
    correct = 0
    share = torch.arange(data.rank, len(data.x_test), data.world)
    dtype = next(module.parameters()).dtype
    with torch.no_grad():
        for chunk in share.split(1000):
            correct += int((module(data.x_test[chunk].to(dtype)).argmax(1) ==
                            data.y_test[chunk]).sum())
    module.train()
    counts = torch.tensor([float(correct), float(len(share))], dtype=torch.float64)
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def parameter_digest(module: Any) -> str:
    """SHA-256 of every parameter's bytes, in order: equal digests mean bit-identical replicas.
    A sharded parameter (a DTensor) is gathered whole first (a collective)."""
    import torch

    digest = hashlib.sha256()
    for p in module.parameters():
        p = p.detach()
        if hasattr(p, "full_tensor"):
            p = p.full_tensor()
        if p.dtype in (torch.bfloat16, torch.float16):
            p = p.float()  # numpy has no bfloat16; widening is exact
        digest.update(p.contiguous().numpy().tobytes())
    return digest.hexdigest()


# ---- one rank -------------------------------------------------------------------------------


def _median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


class _Meter:
    """Counts bytes over the training steps only: evaluation's collectives stay outside."""

    def __init__(self, ifname: Optional[str], state: Optional[Any]) -> None:
        self.ifname, self.state = ifname, state
        self.wire = 0 if interface_tx_bytes(ifname) is not None else None
        # A state that counts no payload (torchft's DiLoCo) has bytes_sent None.
        self.payload = 0 if getattr(state, "bytes_sent", None) is not None else None
        # terse.fsdp's state also counts what went to ranks on other hosts.
        self.across = 0 if getattr(state, "bytes_sent_across_hosts", None) is not None else None
        self._marks: Optional[Tuple[Optional[int], ...]] = None

    def _now(self) -> Tuple[Optional[int], ...]:
        return (interface_tx_bytes(self.ifname) if self.wire is not None else None,
                self.state.bytes_sent if self.payload is not None else None,
                self.state.bytes_sent_across_hosts if self.across is not None else None)

    def start(self) -> None:
        self._marks = self._now()

    def stop(self) -> None:
        if self._marks is None:
            return
        wire, payload, across = self._now()
        if self.wire is not None:
            self.wire += wire - self._marks[0]
        if self.payload is not None:
            self.payload += payload - self._marks[1]
        if self.across is not None:
            self.across += across - self._marks[2]
        self._marks = None


def _init_process_group(config: RunConfig) -> None:
    import torch.distributed as dist

    if config.method == "ddp-terse-backend":
        import terse.backend

        terse.backend.configure(codec=config.codec, min_bytes=config.min_bytes)
        dist.init_process_group("cpu:terse")
    else:
        dist.init_process_group("gloo")


def _wrapped_model(config: RunConfig, dtype: Any) -> Any:
    """The model of ``config`` in its method's wrapper: DDP, or FSDP for FSDP_METHODS."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if config.method in ("ddp-powersgd", "ddp-powersgd-batched"):
        # PyTorch's powerSGD_hook starts its second allreduce (of Q) from a callback of the
        # first; with several buckets that callback races the next bucket's hook, the ranks
        # enqueue Gloo collectives in different orders and Gloo aborts ("op.preamble.length <=
        # op.nbytes"). One bucket holding every parameter keeps the order the same everywhere.
        dist._DEFAULT_FIRST_BUCKET_BYTES = 1 << 62
        return DDP(build_model(config.model, config.seed).to(dtype), bucket_cap_mb=1 << 20)
    if config.method in FSDP_METHODS:
        return _fsdp_model(config)
    buckets = {"bucket_cap_mb": config.bucket_mb} if config.bucket_mb > 0 else {}
    return DDP(build_model(config.model, config.seed).to(dtype), **buckets)


def _eval_steps(config: RunConfig, steps_per_epoch: int) -> set:
    """The steps after which test accuracy is measured: ``evals_per_epoch`` in every epoch."""
    eval_steps = set()
    if steps_per_epoch and config.evals_per_epoch > 0:
        for e in range(config.epochs):
            for j in range(1, config.evals_per_epoch + 1):
                eval_steps.add(e * steps_per_epoch + round(j * steps_per_epoch /
                                                           config.evals_per_epoch))
    return eval_steps


class _Rank:
    """One rank's run: made by :func:`_setup`, trained by :func:`_train` (which fills in
    ``times``, ``train_seconds`` and ``curve``), reported by :func:`_result`."""


def _setup(config: RunConfig, started: float) -> _Rank:
    """Joins the process group and builds the model, its communication, optimizer and data."""
    import torch
    import torch.distributed as dist

    run = _Rank()
    run.config = config
    if config.topology:  # which ranks terse's engines take to share a host (docs/topology.md)
        os.environ["TERSE_TOPOLOGY"] = config.topology
    torch.set_num_threads(1)
    _init_process_group(config)
    run.rank, run.world = dist.get_rank(), dist.get_world_size()
    run.spec = spec = MODELS[config.model]
    run.data = data = (lm.TextData(spec.context, spec.batch, config.seed, run.rank, run.world)
                       if spec.task == "lm" else _Data(spec, config, run.rank, run.world))
    run.dtype = getattr(torch, config.dtype)
    run.model = model = _wrapped_model(config, run.dtype)
    run.state = state = (_fsdp_communication(model, config) if config.method in FSDP_METHODS
                         else _communication(model, config, data.steps_per_epoch))
    run.momentum = config.momentum if config.momentum >= 0 else spec.momentum
    run.parameters = sum(p.numel() for p in model.parameters())
    run.label = config.label or method_label(config)

    run.steps_per_epoch = steps_per_epoch = data.steps_per_epoch
    run.total = total = config.steps if config.steps > 0 else steps_per_epoch * config.epochs
    if steps_per_epoch and config.steps <= 0 and total == 0:
        raise ValueError("too few samples for one global batch")
    _optimizer(run, model, total)
    if config.method in DILOCO_METHODS:
        run.optimizer = _diloco(run, model)
        run.state = state = run.optimizer  # what counts the bytes and is closed at the end
    if run.optimizer_name in COMMUNICATING_OPTIMIZERS:
        run.state = state = run.optimizer  # what counts the bytes and is closed at the end
    run.meter = _Meter(os.environ.get("TERSE_IFNAME"), state)
    if config.lr_drops and hasattr(state, "watch"):
        state.watch(run.optimizer)  # a drop makes Accordion's tensors critical
    run.eval_steps = (lm.eval_steps(config.evals_per_epoch, total) if spec.task == "lm"
                      else _eval_steps(config, steps_per_epoch))
    run.progress_every = config.progress_every or max(1, total // 10)
    run.global_batch = spec.batch * run.world
    if run.rank == 0:
        print(f"[{run.label}] {run.world} ranks connected, data ready "
              f"({time.perf_counter() - started:.1f} s); {total} steps of {run.global_batch} "
              "samples", flush=True)
    return run


def _optimizer(run: _Rank, model: Any, total: int) -> None:
    """The run's optimizer (``run.optimizer``, its ``run.lr``) and, for AdamW, its schedule
    over the ``total`` steps (``run.scheduler``; None for SGD, which keeps a constant rate
    outside lr_drops)."""
    import torch

    spec = run.spec
    run.optimizer_name = run.config.optimizer_name()
    run.scheduler = None
    if run.optimizer_name == "adamw":
        run.lr = spec.adamw_lr * run.config.lr_scale
        run.optimizer, run.scheduler = lm.adamw(model.parameters(), run.lr, spec.betas,
                                                spec.weight_decay, spec.eps, total)
    elif run.optimizer_name in COMMUNICATING_OPTIMIZERS:
        run.lr = spec.adamw_lr
        run.optimizer, run.scheduler = _communicating_adam(run, model, total)
    else:
        run.lr = spec.lr
        run.optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=run.momentum)


def _communicating_adam(run: _Rank, model: Any, total: int) -> Tuple[Any, Any]:
    """terse.optim's 1-bit Adam or 0/1 Adam over AdamW's parameter groups, settings and
    schedule, freezing after ``freeze_fraction`` of the ``total`` steps, with its hook on the DDP
    ``model`` (which then sends nothing once the optimizer communicates)."""
    import torch
    import terse.optim

    spec, freeze = run.spec, max(1, round(run.config.freeze_fraction * total))
    parameters = list(model.parameters())
    groups = [{"params": [p for p in parameters if p.dim() >= 2],
               "weight_decay": spec.weight_decay},
              {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    common = dict(lr=spec.adamw_lr, betas=spec.betas, eps=spec.eps, model=model,
                  codec=run.config.optimizer_codec, precondition=run.config.precondition,
                  timeout=run.config.timeout)
    if run.optimizer_name == "onebit-adam":
        optimizer = terse.optim.OneBitAdam(groups, freeze_step=freeze, **common)
    else:
        optimizer = terse.optim.ZeroOneAdam(groups, var_freeze_step=freeze, **common)
    model.register_comm_hook(*optimizer.ddp_hook())
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lm.schedule(total))


def _diloco(run: _Rank, model: Any) -> Any:
    """The run's DiLoCo around its optimizer (whose schedule keeps stepping the inner one):
    terse.diloco's, or torchft's (terse_harness.torchft_diloco)."""
    config = run.config
    knobs = dict(sync_every=config.sync_every, fragments=config.fragments, delay=config.delay,
                 timeout=config.timeout)
    if config.method == "torchft-diloco":
        from terse_harness import torchft_diloco

        return torchft_diloco.make(model, run.optimizer, outer_lr=config.outer_lr,
                                   outer_momentum=config.outer_momentum, **knobs)
    import terse.diloco

    return terse.diloco.DiLoCo(
        model, run.optimizer, mixing=config.mixing, codec=config.codec,
        min_bytes=config.min_bytes, threads=config.threads,
        warmup=round(config.diloco_warmup * config.steps), warmup_codec=config.warmup_codec,
        outer_optimizer=terse.diloco.nesterov(config.outer_lr, config.outer_momentum), **knobs)


def _evaluated(run: _Rank) -> Any:
    """The module evaluated (and digested): the model's, or DiLoCo's global parameters."""
    if run.config.method in DILOCO_METHODS:
        return run.optimizer.global_model()
    return _unwrapped(run.model)


def _finished(run: _Rank, step: int) -> float:
    """After the last step, DiLoCo's last outer step (terse.diloco.DiLoCo.finish); returns its
    seconds, which count as training time."""
    if step != run.total or run.config.method not in DILOCO_METHODS:
        return 0.0
    started = time.perf_counter()
    run.optimizer.finish()
    return time.perf_counter() - started


def _timed_step(run: _Rank, forward: Any) -> Tuple[Any, Tuple[float, float, float]]:
    """One training step: the gradients zeroed, ``forward()``'s loss, its backward pass (which
    includes waiting for DDP's communication), the optimizer's step, then the learning-rate
    schedule's (AdamW's; outside the timing). Returns the loss and the seconds of forward,
    backward and optimizer step."""
    t0 = time.perf_counter()
    run.optimizer.zero_grad(set_to_none=False)
    loss = forward()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    run.optimizer.step()
    t3 = time.perf_counter()
    if run.scheduler is not None:
        run.scheduler.step()
    return loss, (t1 - t0, t2 - t1, t3 - t2)


def _train(run: _Rank) -> None:
    """Runs the training steps, with the evaluations between them and rank 0's progress."""
    import torch.nn.functional as F

    config, data, model, optimizer, meter = (run.config, run.data, run.model, run.optimizer,
                                             run.meter)
    steps_per_epoch, total, label = run.steps_per_epoch, run.total, run.label
    times: List[Tuple[float, float, float]] = []  # (forward, backward, optimizer) after warm-up
    train_seconds = 0.0
    curve: List[Dict[str, float]] = []
    loss_sum, loss_count = 0.0, 0
    step = 0
    while step < total:
        if steps_per_epoch:
            if step > 0 and hasattr(run.state, "epoch_end"):  # the DDP hook's state
                run.state.epoch_end()  # a codec schedule's window, when its windows are epochs
            data.start_epoch(step // steps_per_epoch)
            if step // steps_per_epoch in config.lr_drops:
                for group in optimizer.param_groups:
                    group["lr"] *= config.lr_drop_factor
        for i in range(steps_per_epoch or total):
            if step == total:
                break
            if step == config.warmup_steps:
                meter.start()
            xb, yb = data.batch_of_step(i)
            loss, timed = _timed_step(run, lambda: F.cross_entropy(model(xb.to(run.dtype)), yb))
            train_seconds += sum(timed)
            if step >= config.warmup_steps:
                times.append(timed)
            loss_sum += loss.item()
            loss_count += 1
            step += 1
            train_seconds += _finished(run, step)
            if step in run.eval_steps or (steps_per_epoch and step == total):
                meter.stop()
                accuracy = evaluate(_evaluated(run), data)
                curve.append({"step": step, "epoch": step / steps_per_epoch,
                              "train_seconds": train_seconds, "accuracy": accuracy,
                              "wire_bytes": meter.wire, "payload_bytes": meter.payload})
                if run.rank == 0:
                    print(f"[{label}] step {step}/{total} epoch {step / steps_per_epoch:.2f} "
                          f"train time {train_seconds:.1f} s: test accuracy "
                          f"{100 * accuracy:.2f} %", flush=True)
                if step >= config.warmup_steps:
                    meter.start()
            if run.rank == 0 and (step % run.progress_every == 0 or step == total):
                med = _median([sum(t) for t in times])
                rate = f"{run.global_batch / med:,.0f} samples/s" if med else "warming up"
                print(f"[{label}] step {step}/{total} loss {loss_sum / loss_count:.3f} {rate}",
                      flush=True)
                loss_sum, loss_count = 0.0, 0
    meter.stop()
    run.times, run.train_seconds, run.curve = times, train_seconds, curve


def _train_lm(run: _Rank) -> None:
    """The language model's steps (terse_harness.lm): batches of random windows, validation
    loss at ``run.eval_steps``, the optimizer's schedule stepped after every step."""
    config, data, model, meter = run.config, run.data, run.model, run.meter
    total, label = run.total, run.label
    times: List[Tuple[float, float, float]] = []
    train_seconds, curve = 0.0, []
    loss_sum, loss_count = 0.0, 0
    for step in range(total):
        if step == config.warmup_steps:
            meter.start()
        xb, yb = data.batch_of_step(step)
        loss, timed = _timed_step(run, lambda: lm.loss_of(model, xb, yb))
        train_seconds += sum(timed)
        if step >= config.warmup_steps:
            times.append(timed)
        loss_sum, loss_count = loss_sum + loss.item(), loss_count + 1
        done = step + 1
        train_seconds += _finished(run, done)
        if done in run.eval_steps:
            meter.stop()
            val_loss = lm.evaluate_loss(_evaluated(run), data)
            curve.append({"step": done, "train_seconds": train_seconds, "val_loss": val_loss,
                          "wire_bytes": meter.wire, "payload_bytes": meter.payload})
            if run.rank == 0:
                print(f"[{label}] step {done}/{total} train time {train_seconds:.1f} s: "
                      f"validation loss {val_loss:.4f}", flush=True)
            if done >= config.warmup_steps:
                meter.start()
        if run.rank == 0 and (done % run.progress_every == 0 or done == total):
            med = _median([sum(t) for t in times])
            rate = f"{run.global_batch / med:,.1f} windows/s" if med else "warming up"
            print(f"[{label}] step {done}/{total} loss {loss_sum / loss_count:.3f} {rate}",
                  flush=True)
            loss_sum, loss_count = 0.0, 0
    meter.stop()
    run.times, run.train_seconds, run.curve = times, train_seconds, curve


def _gather(run: _Rank) -> Tuple[List[Optional[Dict[str, Any]]], List[Any], Optional[Any]]:
    """Every rank's bytes per step and digest (gathered on every rank), and the terse state's
    final plan and codec schedule; closes that state."""
    import torch.distributed as dist

    meter, state, timed = run.meter, run.state, len(run.times)
    mine = {
        "wire_bytes_per_step": meter.wire / timed if meter.wire is not None and timed else None,
        "payload_bytes_per_step": (meter.payload / timed if meter.payload is not None and timed
                                   else None),
        "across_bytes_per_step": (meter.across / timed if meter.across is not None and timed
                                  else None),
        "digest": parameter_digest(_evaluated(run)),
    }
    everyone: List[Optional[Dict[str, Any]]] = [None] * run.world
    dist.all_gather_object(everyone, mine)
    plan = []
    schedule = None
    if state is not None:
        if hasattr(state, "plan"):
            plan = [(name, n, p.codec, p.strategy, p.partitions)
                    for name, n, p in state.plan()]
        if getattr(state, "schedule", None) is not None:
            schedule = state.schedule.state_dict()  # the final decisions (no tensors in it)
        if run.config.method in DILOCO_METHODS:
            run.diloco_stats = state.stats()
        state.close()
    return everyone, plan, schedule


def _result(run: _Rank, everyone: List[Optional[Dict[str, Any]]], plan: List[Any],
            schedule: Optional[Any]) -> Dict[str, Any]:
    """Rank 0's result (the keys :func:`run_rank` describes)."""
    import torch

    def mean_over_ranks(key: str) -> Optional[float]:
        values = [r[key] for r in everyone]
        return None if any(v is None for v in values) else sum(values) / len(values)

    config, spec, times, curve = run.config, run.spec, run.times, run.curve
    global_batch = run.global_batch
    steps = [sum(t) for t in times]
    median_step = _median(steps)
    target = spec.target_accuracy
    reached = [c for c in curve if target is not None and c["accuracy"] >= target]
    lm_task = spec.task == "lm"
    reached_loss = lm.first_reached(curve, spec.target_loss) if lm_task else None
    digests = [r["digest"] for r in everyone]
    return {
        "config": dataclasses.asdict(config), "label": run.label, "model": config.model,
        "model_description": spec.description, "method": config.method,
        "ranks": run.world, "batch_per_rank": spec.batch, "global_batch": global_batch,
        "torch_version": torch.__version__.split("+")[0],
        "task": spec.task, "optimizer": run.optimizer_name,
        "lr": run.lr, "momentum": run.momentum, "parameters": run.parameters,
        "gradient_bytes": run.parameters * 4, "train_samples": run.data.train_size,
        "steps_per_epoch": run.steps_per_epoch, "steps": run.total, "timed_steps": len(times),
        "samples_per_second": global_batch / median_step if median_step else None,
        "median_step_seconds": median_step,
        "median_forward_seconds": _median([t[0] for t in times]),
        "median_backward_seconds": _median([t[1] for t in times]),
        "median_optimizer_seconds": _median([t[2] for t in times]),
        "step_seconds": steps,
        "train_seconds": run.train_seconds, "curve": curve,
        "test_accuracy": curve[-1]["accuracy"] if curve and not lm_task else None,
        "target_accuracy": target,
        "time_to_accuracy": reached[0]["train_seconds"] if reached else None,
        "epochs_to_accuracy": reached[0]["epoch"] if reached else None,
        "context": spec.context if lm_task else None,
        "val_loss": curve[-1]["val_loss"] if curve and lm_task else None,
        "target_loss": spec.target_loss if lm_task else None,
        "time_to_loss": reached_loss["train_seconds"] if reached_loss else None,
        "steps_to_loss": reached_loss["step"] if reached_loss else None,
        "wire_bytes_per_step": mean_over_ranks("wire_bytes_per_step"),
        "wire_bytes_per_step_by_rank": [r["wire_bytes_per_step"] for r in everyone],
        "payload_bytes_per_step": mean_over_ranks("payload_bytes_per_step"),
        # terse.fsdp: the engine's payload bytes to ranks on other hosts, by rank. Where hosts
        # hold several ranks, each rank's wire_bytes_per_step is its host's link (all its ranks).
        "across_bytes_per_step_by_rank": [r.get("across_bytes_per_step") for r in everyone],
        "interface": os.environ.get("TERSE_IFNAME"),
        "digests": digests, "replicas_identical": len(set(digests)) == 1, "plan": plan,
        "schedule": schedule,
        # DiLoCo: outer_steps, bytes_sent, exchange_seconds, waited_seconds, hidden (rank 0's).
        "diloco": getattr(run, "diloco_stats", None),
    }


def run_rank(config: RunConfig) -> Optional[Dict[str, Any]]:
    """Trains one rank of ``config`` (torch.distributed's environment: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT; TERSE_IFNAME names the interface whose bytes are counted).

    Returns on rank 0 (None elsewhere) a dict with the configuration and: ``steps``,
    ``timed_steps`` (after warm-up), ``samples_per_second`` (global batch / median step time),
    ``median_step_seconds`` and the medians of its ``forward``/``backward``/``optimizer`` parts,
    ``train_seconds`` (every step, evaluation excluded), ``curve`` (evaluations: step, epoch,
    train_seconds, accuracy, and rank 0's ``wire_bytes`` and ``payload_bytes`` sent so far
    after the warm-up steps, None where not counted), ``test_accuracy`` (at the end),
    ``time_to_accuracy`` (the training time of the first evaluation at the model's target, or
    None),
    ``wire_bytes_per_step`` (per rank, mean over ranks, measured on the interface),
    ``payload_bytes_per_step`` (terse's count), ``gradient_bytes``, ``digests``,
    ``replicas_identical``, ``optimizer``; for the language model (task "lm") the curve's
    evaluations carry ``val_loss`` (nats per byte) instead of accuracy, and the result has
    ``val_loss`` (at the end), ``target_loss``, ``time_to_loss`` and ``steps_to_loss`` (the
    training time and step of the first evaluation at or below the target, or None); and, under
    a codec schedule, ``schedule`` (its final decisions:
    terse.Accordion's or terse.SparseWarmup's ``state_dict()``).
    """
    import torch.distributed as dist

    started = time.perf_counter()
    run = _setup(config, started)
    (_train_lm if run.spec.task == "lm" else _train)(run)
    everyone, plan, schedule = _gather(run)
    result = _result(run, everyone, plan, schedule) if run.rank == 0 else None
    # DDP's reducer holds the process group: if it outlived destroy_process_group(), its
    # destructor would join Gloo's threads while holding the GIL, which a thread still freeing a
    # tensor waits for (a torch 1.13 deadlock at exit). So the model (with the rest of the
    # rank's run) goes first.
    del run
    gc.collect()
    dist.destroy_process_group()
    return result


# ---- launching the ranks --------------------------------------------------------------------


class _MachineLoad:
    """How busy the machine was while a run's ranks ran: this machine is shared, and CPU time
    taken by other processes slows every method's steps. Compares the machine's busy CPU time
    (/proc/stat) with the CPU time of the run's own processes (waited-for children)."""

    def __init__(self) -> None:
        self.busy, self.total = self._stat()
        self.own = self._own()
        self.loadavg = self._loadavg()

    @staticmethod
    def _stat() -> Tuple[float, float]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        ticks = os.sysconf("SC_CLK_TCK")
        idle = fields[3] + fields[4]  # idle, iowait
        return (sum(fields) - idle) / ticks, sum(fields) / ticks

    @staticmethod
    def _own() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    @staticmethod
    def _loadavg() -> float:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])

    def finish(self) -> Dict[str, float]:
        busy, total = self._stat()
        own = self._own() - self.own
        cores = os.cpu_count() or 1
        return {"cores": cores, "cpu_seconds_busy": busy - self.busy,
                "cpu_seconds_available": total - self.total,
                "cpu_seconds_this_run": own,
                "cpu_seconds_others": max(0.0, busy - self.busy - own),
                "loadavg_start": self.loadavg, "loadavg_end": self._loadavg()}


def launch(config: RunConfig, out: str, ranks: int = 4, link: str = "",
           log: Optional[str] = None, echo: bool = True,
           ranks_per_host: int = 1) -> Dict[str, Any]:
    """Runs ``config`` on ``ranks`` ranks of this machine and returns rank 0's result (also
    written to ``out``), with ``wall_seconds`` (the whole run, start-up included) and ``link``.

    ``link`` empty or "loopback": local processes over loopback (``terse run``). Otherwise
    (root only) each rank gets its own emulated host from scripts/cluster.sh with links of that
    rate, or "unshaped" veth links, and the bytes each rank sends are counted on its eth0; with
    ``ranks_per_host`` > 1 each host holds that many ranks, and eth0 counts the host's link (what
    all its ranks send to other hosts).
    ``log``: a file that receives every rank's output; ``echo``: also print rank 0's lines.
    """
    worker = launcher.python_module("terse_harness.training", "--config",
                                    json.dumps(dataclasses.asdict(config)), "--out", out)
    if os.path.exists(out):
        os.remove(out)
    machine = _MachineLoad()
    with open(log, "w") if log else open(os.devnull, "w") as sink:
        def show(line: str, rank0: str) -> None:
            sink.write(line)
            if echo and line.startswith(rank0):
                print(line[len(rank0):], end="", flush=True)

        status, lines, wall = launcher.run(worker, ranks, link, config.timeout, on_line=show,
                                           ranks_per_host=ranks_per_host)
    if status != 0 or not os.path.exists(out):
        tail = "".join(lines[-40:])
        raise RuntimeError(f"{config.label or method_label(config)}: the run failed "
                           f"(exit status {status}); last output:\n{tail}")
    with open(out) as f:
        result = json.load(f)
    result["wall_seconds"] = wall
    result["link"] = link or "loopback"
    result["ranks_per_host"] = ranks_per_host
    result["machine"] = machine.finish()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python3 -m terse_harness.training",
                                description="One rank of a training run "
                                            "(see terse_harness.training).")
    p.add_argument("--config", required=True, help="RunConfig as JSON")
    p.add_argument("--out", required=True, help="where rank 0 writes the result (JSON)")
    args = p.parse_args(argv)
    result = run_rank(RunConfig(**json.loads(args.config)))
    if result is not None:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
