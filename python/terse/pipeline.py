"""Pipeline parallelism with compressed stage boundaries (``terse.torch.pipeline``).

A model given as an ``nn.Sequential`` (or a list of modules) is cut into S stages, one process
each (rank s runs stage s; with ``replicas=R``, ranks ``s*R .. s*R+R-1`` are data-parallel
replicas of stage s). Every training step runs M micro-batches through the stages with a GPipe
schedule (all forwards, then all backwards) or 1F1B; stage boundaries exchange activations
forward and their gradients backward through :class:`terse.Channel`, and autograd is correct
across them: a stage receives its input, marks it as requiring a gradient, runs its layers,
sends the output; in backward it receives the gradient of its output, back-propagates, and sends
the gradient of its input.

Each boundary and direction has a compressor:

- a terse codec spec (``"fp16"``, ``"minmax8:bits=4"``, ``"topk:ratio=0.1"``, ...): the receiver
  computes on the decoded activation; the sender back-propagates the gradient it gets for the
  decoded activation as if it were its own (straight-through);
- :class:`Autoencoder` (forward only): a learned linear encoder at the end of the sending stage
  and decoder at the start of the receiving one, trained with the model; its code crosses the
  link forward and the gradient of the code backward, so both directions shrink;
- :class:`Delta` (forward only; AQ-SGD, Wang et al., NeurIPS 2022): both sides cache each
  sample's activation as the receiver knows it, keyed by the sample's index; the first visit of
  a sample sends it in full, later visits the codec-compressed change since the last visit.

Gradients of parameters accumulate over micro-batches in the schedule's backward order (GPipe:
micro-batch M-1 down to 0; 1F1B: 0 up to M-1), the loss of micro-batch m weighted by its share
of the batch, so a lossless pipeline computes the full batch's mean-loss gradient up to the
order of float summation (single-process training with the same micro-batches in the same order
gives the same bits).
"""

import itertools
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

import terse
from terse.pipeline_boundary import InBoundary, OutBoundary
from terse.pipeline_compressors import (Autoencoder, Compressor, Delta, _check_delta_codec,
                                        parse_compressor)
# terse.pipeline_model applies an autoencoder as the runtime does, through this name.
from terse.pipeline_compressors import _along  # noqa: F401
from terse.pipeline_profile import Measurements
from terse.pipeline_wire import Wire

__all__ = ["Autoencoder", "Delta", "Pipeline", "parse_compressor", "pipeline", "split_balance"]

# The jobs of a stage, one module each: the compressors and their text forms
# (pipeline_compressors), the messages and the step header (pipeline_wire), each boundary's shape,
# autoencoder halves and Delta caches (pipeline_boundary), the profile (pipeline_profile); this
# module places the stages and runs the schedules and the replicas' allreduce.


# ---- splitting a model ----------------------------------------------------------------------

def split_balance(modules: Sequence[nn.Module], stages: int) -> List[int]:
    """Modules per stage: contiguous cuts that balance parameter counts, each cut right before a
    module with parameters (so activations and norms stay with the layer before them)."""
    n = len(modules)
    if not 1 <= stages <= n:
        raise terse.InvalidArgument(f"cannot split {n} modules into {stages} stages")
    weights = [sum(p.numel() for p in m.parameters()) for m in modules]
    cuttable = [i for i in range(1, n) if weights[i] > 0] or list(range(1, n))
    if len(cuttable) < stages - 1:
        cuttable = list(range(1, n))
    total = sum(weights) or n
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + (w if sum(weights) else 1))
    cuts: List[int] = []
    for s in range(1, stages):
        target = total * s / stages
        candidates = [i for i in cuttable if (not cuts or i > cuts[-1])
                      and len([c for c in cuttable if c > i]) >= stages - 1 - s]
        best = min(candidates, key=lambda i: abs(prefix[i] - target))
        cuts.append(best)
    bounds = [0] + cuts + [n]
    return [bounds[i + 1] - bounds[i] for i in range(stages)]


# ---- the runtime ----------------------------------------------------------------------------

class Pipeline:
    """One stage of a pipeline-parallel model; every rank of the job creates it with the same
    arguments. See the module docstring and docs/pipeline.md.

    Arguments:

    modules
        The whole model as an ``nn.Sequential`` or a list of modules, built identically on every
        rank (same seed); each rank keeps its stage's slice and drops the rest.
    stages
        S, the number of stages (default: world size / replicas).
    balance
        Modules per stage (default :func:`split_balance`, by parameter count).
    micro_batches
        M, micro-batches per step; a batch of B samples is split with ``torch.tensor_split``.
    schedule
        ``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"``.
    forward, backward
        Compressors of every boundary's activations and gradients (default ``"none"``): a codec
        spec, :class:`Autoencoder` or :class:`Delta` (forward only), or their text forms
        (:func:`parse_compressor`). ``boundaries`` overrides them per boundary:
        ``{b: (forward, backward)}``, boundary b sitting between stage b and b+1.
    uncompressed_boundaries
        The first this-many boundaries (nearest the input) send fp32 both ways.
    warmup_steps
        Steps at the start during which every boundary sends fp32 (an autoencoder is then
        initialized from the activations' principal components).
    loss_fn
        ``loss_fn(output, target)`` on the last stage, a mean over the micro-batch (default
        cross-entropy).
    replicas, replica_codec
        R data-parallel replicas per stage; their gradients (stage and autoencoder parameters)
        are averaged by terse's engine with ``replica_codec`` after each backward.
    seed
        Seed of stochastic codecs and of autoencoder initialization (the same on every rank).
    timeout
        Seconds every wait is bounded by (None: ``TERSE_TIMEOUT``, else 60).
    communicator
        A terse Communicator over all S*R ranks (default: from torch.distributed or torchrun's
        environment, see :func:`terse.torch.communicator_for`).
    """

    def __init__(
        self,
        modules: Union[nn.Sequential, Sequence[nn.Module]],
        stages: Optional[int] = None,
        *,
        balance: Optional[Sequence[int]] = None,
        micro_batches: int = 4,
        schedule: str = "gpipe",
        forward: Compressor = "none",
        backward: str = "none",
        boundaries: Optional[Dict[int, Tuple[Compressor, str]]] = None,
        uncompressed_boundaries: int = 0,
        warmup_steps: int = 0,
        loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        replicas: int = 1,
        replica_codec: str = "none",
        seed: int = 0,
        timeout: Optional[float] = None,
        communicator: Optional[terse.Communicator] = None,
    ) -> None:
        modules = list(modules)
        if schedule not in ("gpipe", "1f1b"):
            raise terse.InvalidArgument(f"schedule must be 'gpipe' or '1f1b', not {schedule!r}")
        if micro_batches < 1:
            raise terse.InvalidArgument(f"micro_batches must be >= 1, not {micro_batches}")
        if replicas < 1:
            raise terse.InvalidArgument(f"replicas must be >= 1, not {replicas}")
        self._store = None
        self._id = next(_pipeline_ids)
        if communicator is None:
            rank, size, self._store = _bootstrap(timeout)
            communicator = terse.Communicator(rank, size, self._store, timeout=timeout,
                                              prefix=f"pipeline-{self._id}")
        self.comm = communicator
        world = communicator.size
        if stages is None:
            stages = world // replicas
        if stages * replicas != world:
            raise terse.InvalidArgument(
                f"rank {communicator.rank}: {stages} stages x {replicas} replicas need "
                f"{stages * replicas} ranks, the job has {world}")
        self.stages, self.replicas = stages, replicas
        self.rank = communicator.rank
        self.stage, self.replica = divmod(self.rank, replicas)
        self.micro_batches = micro_batches
        self.schedule = schedule
        self.warmup_steps = warmup_steps
        self.loss_fn = loss_fn or nn.functional.cross_entropy
        self.seed = seed
        self.is_first = self.stage == 0
        self.is_last = self.stage == stages - 1
        self.prev = self.rank - replicas if not self.is_first else None
        self.next = self.rank + replicas if not self.is_last else None

        self.balance = list(balance) if balance is not None else split_balance(modules, stages)
        if len(self.balance) != stages or sum(self.balance) != len(modules) or min(
                self.balance) < 1:
            raise terse.InvalidArgument(
                f"balance {self.balance} must give each of {stages} stages at least one of the "
                f"{len(modules)} modules")
        start = sum(self.balance[:self.stage])
        self.module = nn.Sequential(*modules[start:start + self.balance[self.stage]])

        # Compressors per boundary, validated identically on every rank before anything is sent.
        self.compressors: List[Tuple[Compressor, str]] = []
        for b in range(stages - 1):
            fwd, bwd = (boundaries or {}).get(b, (forward, backward))
            fwd = parse_compressor(fwd)
            bwd = parse_compressor(bwd)
            if not isinstance(bwd, str):
                raise terse.InvalidArgument(
                    f"boundary {b}: the backward compressor must be a codec spec; autoencoder "
                    "and delta compress activations (an autoencoder shrinks the gradient too)")
            if isinstance(fwd, Delta):
                _check_delta_codec(fwd.codec)
            elif isinstance(fwd, str) and fwd.split(":")[0] != "none":
                terse.Codec(fwd)  # a stateful or multi-round codec cannot compress a message
            if b < uncompressed_boundaries:
                fwd, bwd = "none", "none"
            self.compressors.append((fwd, bwd))
        self.in_boundary = (InBoundary(self.stage - 1, *self.compressors[self.stage - 1], seed)
                            if not self.is_first else None)
        self.out_boundary = (OutBoundary(self.stage, *self.compressors[self.stage], seed)
                             if not self.is_last else None)

        self._measured = Measurements()
        self._wire = Wire(communicator, seed, self.rank, self.stage, self.prev, self.next,
                          self._measured)

        self._engine = None
        self.replica_codec = replica_codec
        if replicas > 1:
            if self._store is None:
                raise terse.InvalidArgument(
                    "replicas > 1: let the pipeline create its communicator (it needs the "
                    "rendezvous store for each stage's replica group)")
            sub = terse.Communicator(self.replica, replicas, self._store, timeout=timeout,
                                     prefix=f"pipeline-{self._id}-stage-{self.stage}")
            self._engine = terse.Engine(sub, terse.EngineOptions(seed=seed, threads=1))

        self.steps = 0  # training steps
        self._calls = 0  # steps and predictions: every stage counts them alike
        self._ready = False

    # What this stage measured since the last reset_profile() (terse.pipeline_profile).
    timer = property(lambda self: self._measured.timer)
    step_seconds = property(lambda self: self._measured.step_seconds)
    bytes_by_message = property(lambda self: self._measured.bytes_by_message)

    # ---- what this stage owns -----------------------------------------------------------------

    def parameters(self) -> Iterable[nn.Parameter]:
        """This stage's parameters, including its autoencoder halves (give them to the
        optimizer). Autoencoder halves exist once the boundary shapes are known; create the
        optimizer after :meth:`setup` (called by the first :meth:`step`)."""
        yield from self.module.parameters()
        for boundary in (self.in_boundary, self.out_boundary):
            if boundary is not None and boundary.module is not None:
                yield from boundary.module.parameters()

    def named_parameters(self) -> Iterable[Tuple[str, nn.Parameter]]:
        for name, p in self.module.named_parameters():
            yield f"stage{self.stage}.{name}", p
        if self.in_boundary is not None and self.in_boundary.module is not None:
            for name, p in self.in_boundary.module.named_parameters():
                yield f"decoder{self.in_boundary.index}.{name}", p
        if self.out_boundary is not None and self.out_boundary.module is not None:
            for name, p in self.out_boundary.module.named_parameters():
                yield f"encoder{self.out_boundary.index}.{name}", p

    # ---- boundary shapes and autoencoders -------------------------------------------------------

    @torch.no_grad()
    def setup(self, example: Optional[torch.Tensor] = None) -> None:
        """Learns every boundary's per-sample shape (a collective: every stage calls it; the
        first passes an example batch, e.g. ``inputs[:2]``) and creates the autoencoder halves.
        Create the optimizer after it when an autoencoder is used, since its parameters are
        created here. :meth:`step` calls it on first use."""
        if self._ready:
            return
        if self.is_first:
            if example is None:
                raise terse.InvalidArgument(f"rank {self.rank}: setup() needs an example input "
                                            "on the first stage")
            x = example[:2]
        else:
            self.in_boundary.learn_shape(self._wire)
            x = torch.zeros((2,) + self.in_boundary.sample_shape)
        if not self.is_last:
            # Evaluation mode: batch norm and dropout must not change state for a shape probe.
            training = self.module.training
            self.module.eval()
            try:
                y = self.module(x)
            finally:
                self.module.train(training)
            self.out_boundary.learn_shape(y, self._wire)
        self._ready = True

    def _fit_autoencoders(self) -> None:
        """At the end of the warm-up: principal components of the last activations."""
        if self.out_boundary is not None:
            self.out_boundary.fit_autoencoder(self._wire, self._engine)
        if self.in_boundary is not None:
            self.in_boundary.fit_autoencoder(self._wire)

    def _compressing(self) -> bool:
        return self.steps >= self.warmup_steps

    # ---- one step -----------------------------------------------------------------------------

    def step(self, inputs: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None,
             indices: Optional[torch.Tensor] = None) -> Optional[float]:
        """One training step over a batch: forward and backward of M micro-batches, gradients
        accumulated into this stage's parameters (call ``optimizer.step()`` afterwards).

        ``inputs`` is needed on the first stage, ``targets`` on the last, ``indices`` (int64
        sample ids, for :class:`Delta`) on the first; other stages may pass them or ``None``.
        Returns the batch's mean loss on the last stage, None elsewhere.

        An error on any stage (a NaN the codecs refuse, a dead peer, a timeout) fails the
        pipeline's communicator, so every stage raises promptly instead of waiting for messages
        that will not come; the pipeline cannot be used afterwards.
        """
        try:
            return self._step(inputs, targets, indices)
        except BaseException as e:
            self._abort(e)
            raise

    def _abort(self, error: BaseException) -> None:
        self.comm.abort(f"rank {self.rank} (pipeline stage {self.stage}) failed: "
                        f"{type(error).__name__}: {error}")

    def _step(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor],
              indices: Optional[torch.Tensor]) -> Optional[float]:
        started, started_cpu = time.perf_counter(), time.thread_time()
        batch = inputs.shape[0] if self.is_first else 0
        if self.is_first and indices is not None and len(indices) != batch:
            raise terse.InvalidArgument(f"{len(indices)} indices for a batch of {batch}")
        if indices is not None:
            indices = indices.to(torch.int64)
            if int(indices.min()) < 0 or int(indices.max()) >= 1 << 32:
                raise terse.InvalidArgument("sample indices must lie in [0, 2^32)")
        self.setup(inputs)
        if self.steps == self.warmup_steps and self.warmup_steps > 0:
            self._fit_autoencoders()
        batch, indices, _ = self._wire.header(self._calls, batch,
                                              indices if self.is_first else None, False)
        if self.is_last and targets is None:
            raise terse.InvalidArgument(f"rank {self.rank}: the last stage needs targets")
        M = min(self.micro_batches, batch)
        sizes = [len(c) for c in torch.arange(batch).tensor_split(M)]
        bounds = [sum(sizes[:m]) for m in range(M + 1)]
        rows = [indices[bounds[m]:bounds[m + 1]] if indices is not None else None
                for m in range(M)]
        if self.in_boundary is not None:
            posted = self.in_boundary.post_recvs(sizes, rows, False, self._compressing(),
                                                 self._wire)

        leaves: List[Optional[torch.Tensor]] = [None] * M
        outputs: List[Optional[torch.Tensor]] = [None] * M
        grad_posted: List[Any] = [None] * M
        losses: List[float] = []

        def forward(m: int) -> None:
            if self.is_first:
                leaf, x = None, inputs[bounds[m]:bounds[m + 1]]
            else:
                leaf, x = self.in_boundary.take(posted[m], sizes[m], self._wire)
            with self.measure("forward"):
                y = self.module(x)
            if self.is_last:
                with self.measure("forward"):
                    loss = self.loss_fn(y, targets[bounds[m]:bounds[m + 1]]) * (sizes[m] / batch)
                losses.append(float(loss.detach()))
                outputs[m] = loss
            else:
                self.out_boundary.learn_shape(y, self._wire)
                if self.steps < self.warmup_steps:
                    self.out_boundary.remember_for_pca(y)
                outputs[m] = self.out_boundary.send(y, rows[m], False, self._compressing(),
                                                    self._wire)
                if self.schedule == "1f1b":  # gradients come back in forward order
                    post_grad(m)
            leaves[m] = leaf

        def post_grad(m: int) -> None:
            # The k-th gradient received matches the k-th one the next stage sends, so receives
            # are posted in the order of its backward passes.
            if not self.is_last:
                grad_posted[m] = self._wire.recv_next("grad", self.out_boundary.index,
                                                      tuple(outputs[m].shape),
                                                      self._backward_codec(self.out_boundary))

        def backward(m: int) -> None:
            if self.is_last:
                with self.measure("backward"):
                    outputs[m].backward()
            else:
                grad, handle = grad_posted[m]
                self._wire.wait(handle, "gradient")
                with self.measure("backward"):
                    torch.autograd.backward(outputs[m], grad)
            if leaves[m] is not None:
                self._wire.send_prev("grad", self.in_boundary.index, leaves[m].grad,
                                     self._backward_codec(self.in_boundary))
            leaves[m] = outputs[m] = grad_posted[m] = None

        if self.schedule == "gpipe":
            for m in range(M):
                forward(m)
            for m in reversed(range(M)):
                post_grad(m)
            for m in reversed(range(M)):
                backward(m)
        else:
            warm = min(self.stages - self.stage - 1, M)
            for m in range(warm):
                forward(m)
            for m in range(warm, M):
                forward(m)
                backward(m - warm)
            for m in range(M - warm, M):
                backward(m)

        self._allreduce_replicas()
        self._wire.finish_sends()
        self.steps += 1
        self._calls += 1
        self.step_seconds.append(time.perf_counter() - started)
        self.timer.add("step", self.step_seconds[-1], time.thread_time() - started_cpu)
        return sum(losses) if self.is_last else None

    def _backward_codec(self, boundary: Union[InBoundary, OutBoundary]) -> str:
        return boundary.backward if self._compressing() else "none"

    def _allreduce_replicas(self) -> None:
        if self._engine is None:
            return
        with self.measure("replicas"):
            items = []
            for name, p in self.named_parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                items.append((name, p.grad, terse.AllreduceOptions(codec=self.replica_codec)))
            items.sort(key=lambda item: item[0])
            self._engine.allreduce_group(items).wait()

    # ---- inference ----------------------------------------------------------------------------

    def predict(self, inputs: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The model's output for a batch (forward only, M micro-batches, boundaries compressed
        as in training except :class:`Delta`, which sends fp32). Returns the output on the last
        stage, None elsewhere. Every stage calls it together; errors fail all, as in step()."""
        try:
            return self._predict(inputs)
        except BaseException as e:
            self._abort(e)
            raise

    @torch.no_grad()
    def _predict(self, inputs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        self.setup(inputs)
        batch = inputs.shape[0] if self.is_first else 0
        batch, _, _ = self._wire.header(self._calls, batch, None, True)
        M = min(self.micro_batches, batch)
        sizes = [len(c) for c in torch.arange(batch).tensor_split(M)]
        bounds = [sum(sizes[:m]) for m in range(M + 1)]
        if self.in_boundary is not None:
            posted = self.in_boundary.post_recvs(sizes, [None] * M, True, self._compressing(),
                                                 self._wire)
        outs = []
        for m in range(M):
            if self.is_first:
                x = inputs[bounds[m]:bounds[m + 1]]
            else:
                _, x = self.in_boundary.take(posted[m], sizes[m], self._wire)
            y = self.module(x)
            if self.is_last:
                outs.append(y)
            else:
                self.out_boundary.learn_shape(y, self._wire)
                self.out_boundary.send(y, None, True, self._compressing(), self._wire)
        self._wire.finish_sends()
        self._calls += 1
        return torch.cat(outs) if self.is_last else None

    # ---- measurements -------------------------------------------------------------------------

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank sent through its channels (codec headers included)."""
        return self._wire.bytes_sent

    def measure(self, name: str) -> Any:
        """A context manager adding the wall and CPU time of a block to this stage's profile
        under name (e.g. "optimizer", which the cost model counts as per-step work)."""
        return self._measured.phase(name)

    def reset_profile(self) -> None:
        """Starts a new measurement window for :meth:`profile` (e.g. after warm-up steps)."""
        self._measured.reset()

    def profile(self) -> Dict[str, Any]:
        """What this stage measured since the last :meth:`reset_profile`: per step, wall and CPU
        seconds of each phase (step: the whole of step(); forward, backward, encode_*, wait_*,
        autoencoder, delta, and the caller's :meth:`measure` blocks), bytes
        sent by message kind, and the step times. ``terse plan-pipeline`` calibrates its cost
        model from the profiles of all stages."""
        steps = max(1, len(self.step_seconds))
        return {
            "rank": self.rank, "stage": self.stage, "stages": self.stages,
            "replicas": self.replicas, "micro_batches": self.micro_batches,
            "schedule": self.schedule, "steps": len(self.step_seconds),
            "compressors": [[str(f), b] for f, b in self.compressors],
            "in_shape": list(self.in_boundary.sample_shape) if self.in_boundary and
            self.in_boundary.sample_shape else None,
            "out_shape": list(self.out_boundary.sample_shape) if self.out_boundary and
            self.out_boundary.sample_shape else None,
            "parameters": sum(p.numel() for p in self.module.parameters()),
            "wall_per_step": {k: v / steps for k, v in self.timer.wall.items()},
            "cpu_per_step": {k: v / steps for k, v in self.timer.cpu.items()},
            "bytes_per_step": {k: v / steps for k, v in self.bytes_by_message.items()},
            "step_seconds": list(self.step_seconds),
        }

    def close(self) -> None:
        """Waits for pending sends and releases the channels (and the replicas' engine)."""
        try:
            self._wire.finish_sends()
        finally:
            self._wire.close()
            if self._engine is not None:
                self._engine.close()


# Pipelines created by this process, numbered in creation order (the same on every rank): the
# n-th one's keys in the store get the prefix "pipeline-n".
_pipeline_ids = itertools.count()


def _bootstrap(timeout: Optional[float]) -> Tuple[int, int, terse.Store]:
    """(rank, size, store): torch.distributed's store when it is initialized (under a "terse"
    prefix, as the DDP hook does), else torchrun's environment or TERSE_FILE_STORE."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        store = dist.PrefixStore("terse", dist.distributed_c10d._get_default_store())
        return dist.get_rank(), dist.get_world_size(), terse.python_store(store)
    return terse.bootstrap_from_env(timeout)  # one store per process, shared by every call


def pipeline(modules: Union[nn.Sequential, Sequence[nn.Module]], stages: Optional[int] = None,
             **options: Any) -> Pipeline:
    """``terse.torch.pipeline(model, stages, micro_batches=8, forward="minmax8:bits=4", ...)``:
    this rank's stage of a pipeline (see :class:`Pipeline` for every option)."""
    return Pipeline(modules, stages, **options)
