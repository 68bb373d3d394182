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
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

import terse

__all__ = ["Autoencoder", "Delta", "Pipeline", "parse_compressor", "pipeline", "split_balance"]

_HEADER_MAGIC = 7151.0  # first element of every step header ("terse pipeline")
_MAX_NDIM = 7
_FLAG_INDICES = 1
_FLAG_EVAL = 2
_PCA_ROWS = 8192  # activation rows an autoencoder's initial principal components come from


# ---- compressors ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Autoencoder:
    """A learned linear autoencoder across one boundary (forward direction).

    The encoder, ``Linear(d, k)`` applied along dimension ``dim`` of the sending stage's output,
    lives on the sender; the decoder, ``Linear(k, d)``, on the receiver; both are trained with
    the model by the same optimizer (they are in :meth:`Pipeline.parameters`). ``k`` is
    ``code`` or ``round(ratio * d)``. The code travels with ``codec`` (default ``"none"``) and
    the gradient of the code comes back with the boundary's backward compressor.

    Initialization: with warm-up steps (``Pipeline(warmup_steps=W)``), the sender fits the
    principal components of the last warm-up step's activations (encoder = projection onto the
    top k, decoder = its transpose plus the mean) and sends the decoder to the receiver; without
    warm-up, both sides build the same random orthonormal projection from the pipeline's seed.

    ``dim``: -1 for ``[batch, features]`` and ``[batch, tokens, features]`` activations, 1 for
    ``[batch, channels, height, width]`` (a 1x1 convolution over channels).
    """

    ratio: Optional[float] = 0.1
    code: Optional[int] = None
    dim: int = -1
    codec: str = "none"

    def code_size(self, d: int) -> int:
        k = self.code if self.code is not None else max(1, round(self.ratio * d))
        if not 1 <= k <= d:
            raise terse.InvalidArgument(f"autoencoder code size {k} must be in 1 .. {d}")
        return k

    def __str__(self) -> str:
        size = f"code={self.code}" if self.code is not None else f"ratio={self.ratio:g}"
        extra = f",dim={self.dim}" if self.dim != -1 else ""
        extra += f",codec={self.codec}" if self.codec != "none" else ""
        return f"ae:{size}{extra}"


@dataclass(frozen=True)
class Delta:
    """AQ-SGD's delta compression across one boundary (forward direction).

    Sender and receiver keep, per training sample (its index, given to :meth:`Pipeline.step`),
    the activation as the receiver knows it. A sample's first visit sends it in full (fp32);
    each later visit sends ``codec(activation - cached)`` and both sides add the decoded change
    to their cache, which is what the receiver computes on. So the first epoch is uncompressed,
    as the method requires, and the error never accumulates. The sender mirrors the receiver's
    decoding with :class:`terse.Codec`, so the codec must be deterministic and stateless
    (``minmax8``, ``fp16``, ``bf16``, ``topk``, ``threshold``, ``onebit``, ``tbq``, ...).

    ``cache_dtype``: ``torch.float16`` halves the caches' memory (both sides round alike).
    Evaluation (:meth:`Pipeline.predict`) sends activations in full: the caches are a training
    device and hold no test samples.
    """

    codec: str = "minmax8:bits=4"
    cache_dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        return f"delta:{self.codec}" + (":fp16cache" if self.cache_dtype == torch.float16 else "")


Compressor = Union[str, Autoencoder, Delta]


def parse_compressor(text: Union[str, Autoencoder, Delta]) -> Compressor:
    """A compressor from its command-line form.

    ``"none"`` or any codec spec (``"minmax8:bits=4"``); ``"ae:ratio=0.1"``,
    ``"ae:code=64,dim=1,codec=fp16"``; ``"delta:CODEC"`` (``"delta:minmax8:bits=4"``),
    ``"delta:CODEC:fp16cache"``. Codec specs are validated (``terse.SpecError`` lists what is
    allowed).
    """
    if not isinstance(text, str):
        return text
    if text == "ae" or text.startswith("ae:"):
        kwargs: Dict[str, Any] = {}
        body = text[3:]
        if body:
            for item in _split_ae_args(body):
                key, _, value = item.partition("=")
                if key == "ratio":
                    kwargs["ratio"] = float(value)
                elif key == "code":
                    kwargs["code"] = int(value)
                    kwargs.setdefault("ratio", None)
                elif key == "dim":
                    kwargs["dim"] = int(value)
                elif key == "codec":
                    terse.canonical_spec(value)
                    kwargs["codec"] = value
                else:
                    raise terse.SpecError(
                        f"autoencoder: unknown key '{key}' in '{text}' (allowed: ratio, code, "
                        "dim, codec)")
        return Autoencoder(**kwargs)
    if text.startswith("delta:"):
        body = text[len("delta:"):]
        dtype = torch.float32
        if body.endswith(":fp16cache"):
            body, dtype = body[:-len(":fp16cache")], torch.float16
        _check_delta_codec(body)
        return Delta(codec=body, cache_dtype=dtype)
    terse.canonical_spec(text)
    return text


def _split_ae_args(body: str) -> List[str]:
    # "code=64,codec=minmax8:bits=4,chunk=64" -> the codec takes the rest of the string.
    out: List[str] = []
    rest = body
    while rest:
        if rest.startswith("codec="):
            out.append(rest)
            break
        head, _, rest = rest.partition(",")
        out.append(head)
    return out


def _check_delta_codec(spec: str) -> None:
    codec = terse.Codec(spec)  # refuses stateful codecs (ef=1, dgc) and powersgd
    if codec.traits["stochastic"]:
        raise terse.InvalidArgument(
            f"delta compression needs a deterministic codec (the sender mirrors the receiver's "
            f"cache with its own decoding); {spec} draws random numbers")


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

class _Boundary:
    """What one side of a boundary knows: compressors, shapes, autoencoder halves, caches."""

    def __init__(self, index: int, forward: Compressor, backward: str, seed: int) -> None:
        self.index = index
        self.forward = forward
        self.backward = backward
        self.seed = seed
        self.sample_shape: Optional[Tuple[int, ...]] = None  # per-sample activation shape
        self.module: Optional[nn.Module] = None  # encoder (sender) or decoder (receiver)
        self.cache: Optional[torch.Tensor] = None  # Delta: [capacity, features]
        self.seen: Optional[torch.Tensor] = None  # Delta: bool [capacity]
        self.codec: Optional[terse.Codec] = None  # Delta: the sender's mirror of decoding

    # -- autoencoder helpers
    def ae_dims(self) -> Tuple[int, int]:
        ae = self.forward
        assert isinstance(ae, Autoencoder) and self.sample_shape is not None
        d = self.sample_shape[ae.dim if ae.dim < 0 else ae.dim - 1]
        return d, ae.code_size(d)

    def code_shape(self) -> Tuple[int, ...]:
        ae = self.forward
        assert isinstance(ae, Autoencoder) and self.sample_shape is not None
        shape = list(self.sample_shape)
        shape[ae.dim if ae.dim < 0 else ae.dim - 1] = self.ae_dims()[1]
        return tuple(shape)

    def features(self) -> int:
        assert self.sample_shape is not None
        return math.prod(self.sample_shape)

    # -- delta helpers
    def ensure_cache(self, max_index: int, dtype: torch.dtype) -> None:
        capacity = 0 if self.cache is None else self.cache.shape[0]
        if max_index < capacity:
            return
        new_capacity = max(1024, 1 << (max_index + 1).bit_length())
        cache = torch.zeros(new_capacity, self.features(), dtype=dtype)
        seen = torch.zeros(new_capacity, dtype=torch.bool)
        if self.cache is not None:
            cache[:capacity] = self.cache
            seen[:capacity] = self.seen
        self.cache, self.seen = cache, seen


def _along(module: nn.Module, x: torch.Tensor, dim: int) -> torch.Tensor:
    """Applies a Linear along dimension dim of x."""
    if dim == -1 or dim == x.dim() - 1:
        return module(x)
    return module(x.movedim(dim, -1)).movedim(-1, dim)


class _Timer:
    """Per-step sums of wall and CPU time of named phases (the profile)."""

    def __init__(self) -> None:
        self.wall: Dict[str, float] = {}
        self.cpu: Dict[str, float] = {}
        self.count: Dict[str, int] = {}

    def add(self, name: str, wall: float, cpu: float) -> None:
        self.wall[name] = self.wall.get(name, 0.0) + wall
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu
        self.count[name] = self.count.get(name, 0) + 1


class _Phase:
    def __init__(self, timer: _Timer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.w, self.c = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc: Any) -> None:
        self.timer.add(self.name, time.perf_counter() - self.w, time.thread_time() - self.c)


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
        self.in_boundary = (_Boundary(self.stage - 1, *self.compressors[self.stage - 1], seed)
                            if not self.is_first else None)
        self.out_boundary = (_Boundary(self.stage, *self.compressors[self.stage], seed)
                             if not self.is_last else None)

        # One channel per neighbour and direction: a Channel completes messages on two threads
        # in posting order, and a send completes only once the peer posted the matching
        # receive, so sends and receives sharing threads could wait on each other across
        # stages (1F1B) until the timeout.
        self._channels: List[terse.Channel] = []

        def channel() -> terse.Channel:
            c = terse.Channel(communicator, seed=seed)
            self._channels.append(c)
            return c

        self._to_next = channel() if self.next is not None else None
        self._from_next = channel() if self.next is not None else None
        self._to_prev = channel() if self.prev is not None else None
        self._from_prev = channel() if self.prev is not None else None

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
        self._pending_sends: List[terse.Handle] = []
        self.timer = _Timer()
        self.step_seconds: List[float] = []
        self.bytes_by_message: Dict[str, int] = {}
        self._pca_rows: List[torch.Tensor] = []

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

    # ---- messages -----------------------------------------------------------------------------

    def _name(self, kind: str, boundary: int) -> str:
        return f"pipeline/{kind}{boundary}"

    def _send(self, channel: terse.Channel, peer: int, kind: str, boundary: int,
              x: torch.Tensor, codec: str) -> None:
        x = x.detach()
        if not x.is_contiguous():
            x = x.contiguous()
        name = self._name(kind, boundary)
        before = channel.bytes_sent
        with _Phase(self.timer, f"encode_{kind}"):
            handle = channel.send(peer, name, x, codec)
        self.bytes_by_message[kind] = self.bytes_by_message.get(kind, 0) + (
            channel.bytes_sent - before)
        self._pending_sends.append(handle)

    def _recv(self, channel: terse.Channel, peer: int, kind: str, boundary: int,
              shape: Sequence[int], codec: str) -> Tuple[torch.Tensor, terse.Handle]:
        out = torch.empty(tuple(shape), dtype=torch.float32)
        return out, channel.recv(peer, self._name(kind, boundary), out, codec)

    def _wait(self, handle: terse.Handle, what: str) -> None:
        with _Phase(self.timer, f"wait_{what}"):
            handle.wait()

    def _header(self, batch: int, indices: Optional[torch.Tensor], eval_mode: bool
                ) -> Tuple[int, Optional[torch.Tensor], bool]:
        """Stage 0 states the step (batch size, sample indices); the others receive it from
        their predecessor and pass it on before computing, so every stage can post its receives
        for the whole step at once."""
        if not self.is_first:
            head, handle = self._recv(self._from_prev, self.prev, "header", self.stage - 1, (4,),
                                      "none")
            self._wait(handle, "header")
            if head[0].item() != _HEADER_MAGIC or int(head[1].item()) != (self._calls & 0xffffff):
                raise terse.MismatchError(
                    f"rank {self.rank}: step header from peer {self.prev} says call "
                    f"{int(head[1].item())} (magic {head[0].item()}), this stage is at call "
                    f"{self._calls}: do all stages call step() and predict() alike?")
            batch, flags = int(head[2].item()), int(head[3].item())
            eval_mode = bool(flags & _FLAG_EVAL)
            indices = None
            if flags & _FLAG_INDICES:
                packed, handle = self._recv(self._from_prev, self.prev, "indices",
                                            self.stage - 1, (2, batch), "none")
                self._wait(handle, "header")
                indices = packed[0].to(torch.int64) * 65536 + packed[1].to(torch.int64)
        if not self.is_last:
            flags = (_FLAG_INDICES if indices is not None else 0) | (_FLAG_EVAL if eval_mode
                                                                      else 0)
            head = torch.tensor([_HEADER_MAGIC, float(self._calls & 0xffffff), float(batch),
                                 float(flags)])
            self._send(self._to_next, self.next, "header", self.stage, head, "none")
            if indices is not None:
                packed = torch.stack([(indices // 65536).float(), (indices % 65536).float()])
                self._send(self._to_next, self.next, "indices", self.stage, packed, "none")
        return batch, indices, eval_mode

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
            self._learn_in_shape()
            x = torch.zeros((2,) + self.in_boundary.sample_shape)
        if not self.is_last:
            # Evaluation mode: batch norm and dropout must not change state for a shape probe.
            training = self.module.training
            self.module.eval()
            try:
                y = self.module(x)
            finally:
                self.module.train(training)
            self._learn_out_shape(y)
        self._ready = True

    def _learn_out_shape(self, y: torch.Tensor) -> None:
        """This stage's output fixes the boundary's per-sample shape; the receiver learns it
        from a one-time message."""
        boundary = self.out_boundary
        shape = tuple(y.shape[1:])
        if boundary.sample_shape is not None:
            if shape != boundary.sample_shape:
                raise terse.InvalidArgument(
                    f"rank {self.rank}: stage {self.stage} output has per-sample shape {shape}, "
                    f"earlier {boundary.sample_shape}; boundary shapes must stay fixed")
            return
        if len(shape) > _MAX_NDIM:
            raise terse.InvalidArgument(f"stage output of {len(shape)} dims; at most {_MAX_NDIM}")
        if y.dtype != torch.float32:
            raise TypeError(f"rank {self.rank}: stage {self.stage} outputs {y.dtype}; pipeline "
                            "boundaries carry float32 tensors")
        boundary.sample_shape = shape
        msg = torch.zeros(_MAX_NDIM + 1)
        msg[0] = len(shape)
        msg[1:1 + len(shape)] = torch.tensor(shape, dtype=torch.float32)
        self._send(self._to_next, self.next, "shape", self.stage, msg, "none")
        if isinstance(boundary.forward, Autoencoder):
            boundary.module = self._make_ae_half(boundary, encoder=True)

    def _learn_in_shape(self) -> None:
        boundary = self.in_boundary
        if boundary.sample_shape is not None:
            return
        msg, handle = self._recv(self._from_prev, self.prev, "shape", self.stage - 1,
                                 (_MAX_NDIM + 1,), "none")
        self._wait(handle, "shape")
        ndim = int(msg[0].item())
        boundary.sample_shape = tuple(int(v) for v in msg[1:1 + ndim].tolist())
        if isinstance(boundary.forward, Autoencoder):
            boundary.module = self._make_ae_half(boundary, encoder=False)

    def _make_ae_half(self, boundary: _Boundary, encoder: bool) -> nn.Module:
        d, k = boundary.ae_dims()
        # The same orthonormal basis on both sides, from the shared seed: the pair starts as a
        # projection onto a random k-dimensional subspace (replaced by principal components at
        # the end of a warm-up).
        g = torch.Generator().manual_seed(self.seed * 1000003 + boundary.index)
        q, _ = torch.linalg.qr(torch.randn(d, k, generator=g))
        if encoder:
            m = nn.Linear(d, k)
            with torch.no_grad():
                m.weight.copy_(q.t())
                m.bias.zero_()
        else:
            m = nn.Linear(k, d)
            with torch.no_grad():
                m.weight.copy_(q)
                m.bias.zero_()
        return m

    def _remember_for_pca(self, y: torch.Tensor) -> None:
        out = self.out_boundary
        if not isinstance(out.forward, Autoencoder):
            return
        d, _ = out.ae_dims()
        self._pca_rows.append(y.detach().movedim(out.forward.dim, -1).reshape(-1, d))
        while sum(len(r) for r in self._pca_rows) - len(self._pca_rows[0]) >= _PCA_ROWS:
            self._pca_rows.pop(0)  # the most recent rows describe the trained layers best

    def _fit_autoencoders(self) -> None:
        """At the end of the warm-up: principal components of the last activations."""
        out = self.out_boundary
        if out is not None and isinstance(out.forward, Autoencoder):
            d, k = out.ae_dims()
            rows = torch.cat(self._pca_rows).double()
            self._pca_rows = []
            mean = rows.mean(0)
            if self._engine is not None:
                # Replicas average their statistics so that their autoencoders stay equal.
                stats = torch.cat([mean, ((rows - mean).t() @ (rows - mean)).flatten()]).float()
                self._engine.allreduce("pipeline/pca", stats).wait()
                mean = stats[:d].double()
                cov = stats[d:].view(d, d).double()
            else:
                cov = (rows - mean).t() @ (rows - mean)
            _, vectors = torch.linalg.eigh(cov)
            basis = vectors[:, -k:].flip(1).float().contiguous()  # top k, largest first
            mean = mean.float()
            with torch.no_grad():
                out.module.weight.copy_(basis.t())
                out.module.bias.copy_(-(basis.t() @ mean))
            decoder = torch.cat([basis.flatten(), mean])
            self._send(self._to_next, self.next, "aeinit", out.index, decoder, "none")
        inb = self.in_boundary
        if inb is not None and isinstance(inb.forward, Autoencoder):
            d, k = inb.ae_dims()
            decoder, handle = self._recv(self._from_prev, self.prev, "aeinit", inb.index,
                                         (d * k + d,), "none")
            self._wait(handle, "aeinit")
            with torch.no_grad():
                inb.module.weight.copy_(decoder[:d * k].view(d, k))
                inb.module.bias.copy_(decoder[d * k:])

    # ---- compress / decompress one micro-batch ------------------------------------------------

    def _compressing(self, boundary: _Boundary) -> bool:
        return self.steps >= self.warmup_steps

    def _send_activation(self, y: torch.Tensor, rows: Optional[torch.Tensor], eval_mode: bool
                         ) -> torch.Tensor:
        """Sends this stage's output y forward; returns the tensor whose gradient will come
        back (y, or the autoencoder's code)."""
        boundary = self.out_boundary
        fwd = boundary.forward
        compressing = self._compressing(boundary)
        if isinstance(fwd, Autoencoder) and compressing:
            with _Phase(self.timer, "autoencoder"):
                code = _along(boundary.module, y, fwd.dim)
            self._send(self._to_next, self.next, "act", boundary.index, code, fwd.codec)
            return code
        if isinstance(fwd, Delta) and not eval_mode:
            self._send_delta(boundary, y.detach(), rows, compressing)
            return y
        codec = fwd if isinstance(fwd, str) and compressing else "none"
        self._send(self._to_next, self.next, "act", boundary.index, y, codec)
        return y

    def _send_delta(self, boundary: _Boundary, y: torch.Tensor, rows: Optional[torch.Tensor],
                    compressing: bool) -> None:
        if rows is None:
            raise terse.InvalidArgument(
                f"rank {self.rank}: delta compression on boundary {boundary.index} needs the "
                "samples' indices: step(inputs, targets, indices=...) on the first stage")
        fwd = boundary.forward
        a = y.reshape(y.shape[0], -1)
        with _Phase(self.timer, "delta"):
            boundary.ensure_cache(int(rows.max()), fwd.cache_dtype)
            seen = boundary.seen[rows] if compressing else torch.zeros(len(rows), dtype=torch.bool)
            fresh = ~seen
            if fresh.any():
                full = a[fresh].contiguous()
                boundary.cache[rows[fresh]] = full.to(fwd.cache_dtype)
                boundary.seen[rows[fresh]] = True
        if fresh.any():
            self._send(self._to_next, self.next, "act", boundary.index, full, "none")
        if seen.any():
            with _Phase(self.timer, "delta"):
                if boundary.codec is None:
                    boundary.codec = terse.Codec(fwd.codec)
                old = boundary.cache[rows[seen]].float()
                change = (a[seen] - old).contiguous()
                decoded = torch.empty_like(change)
                boundary.codec.roundtrip(change, decoded)
                boundary.cache[rows[seen]] = (old + decoded).to(fwd.cache_dtype)
            self._send(self._to_next, self.next, "delta", boundary.index, change, fwd.codec)

    def _post_activation_recvs(self, sizes: List[int], rows: List[Optional[torch.Tensor]],
                               eval_mode: bool) -> List[Any]:
        """Posts the receives of every micro-batch's input at once, so transfers overlap
        this stage's computation."""
        boundary = self.in_boundary
        fwd = boundary.forward
        compressing = self._compressing(boundary)
        posted = []
        for b, r in zip(sizes, rows):
            if isinstance(fwd, Autoencoder) and compressing:
                posted.append(("ae",) + self._recv(self._from_prev, self.prev, "act",
                                                   boundary.index, (b,) + boundary.code_shape(),
                                                   fwd.codec))
            elif isinstance(fwd, Delta) and not eval_mode:
                if r is None:
                    raise terse.InvalidArgument(
                        f"rank {self.rank}: delta compression on boundary {boundary.index} "
                        "needs the samples' indices (step(..., indices=...) on stage 0)")
                boundary.ensure_cache(int(r.max()), fwd.cache_dtype)
                seen = boundary.seen[r] if compressing else torch.zeros(len(r), dtype=torch.bool)
                # Mark fresh rows now, in the sender's order, so a sample repeated in a later
                # micro-batch of this step is a delta on both sides.
                fresh = ~seen
                full = delta = None
                if fresh.any():
                    full = self._recv(self._from_prev, self.prev, "act", boundary.index,
                                      (int(fresh.sum()), boundary.features()), "none")
                if seen.any():
                    delta = self._recv(self._from_prev, self.prev, "delta", boundary.index,
                                       (int(seen.sum()), boundary.features()), fwd.codec)
                boundary.seen[r[fresh]] = True
                posted.append(("delta", r, seen, full, delta))
            else:
                codec = fwd if isinstance(fwd, str) and compressing else "none"
                posted.append(("plain",) + self._recv(self._from_prev, self.prev, "act",
                                                      boundary.index,
                                                      (b,) + boundary.sample_shape, codec))
        return posted

    def _take_activation(self, posted: Any, batch: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Waits for one micro-batch's input; returns (leaf whose gradient goes back, input of
        this stage's layers)."""
        boundary = self.in_boundary
        kind = posted[0]
        if kind in ("plain", "ae"):
            x, handle = posted[1], posted[2]
            self._wait(handle, "activation")
            x.requires_grad_(True)
            if kind == "ae":
                with _Phase(self.timer, "autoencoder"):
                    return x, _along(boundary.module, x, boundary.forward.dim)
            return x, x
        _, rows, seen, full, delta = posted
        fwd = boundary.forward
        with _Phase(self.timer, "delta"):
            if full is not None:
                self._wait(full[1], "activation")
                boundary.cache[rows[~seen]] = full[0].to(fwd.cache_dtype)
            if delta is not None:
                self._wait(delta[1], "activation")
                idx = rows[seen]
                boundary.cache[idx] = (boundary.cache[idx].float() + delta[0]).to(
                    fwd.cache_dtype)
            x = boundary.cache[rows].float().view((batch,) + boundary.sample_shape)
        x.requires_grad_(True)
        return x, x

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
        batch, indices, _ = self._header(batch, indices if self.is_first else None, False)
        if self.is_last and targets is None:
            raise terse.InvalidArgument(f"rank {self.rank}: the last stage needs targets")
        M = min(self.micro_batches, batch)
        sizes = [len(c) for c in torch.arange(batch).tensor_split(M)]
        bounds = [sum(sizes[:m]) for m in range(M + 1)]
        rows = [indices[bounds[m]:bounds[m + 1]] if indices is not None else None
                for m in range(M)]
        if self.in_boundary is not None:
            posted = self._post_activation_recvs(sizes, rows, False)

        leaves: List[Optional[torch.Tensor]] = [None] * M
        outputs: List[Optional[torch.Tensor]] = [None] * M
        grad_posted: List[Any] = [None] * M
        losses: List[float] = []

        def forward(m: int) -> None:
            if self.is_first:
                leaf, x = None, inputs[bounds[m]:bounds[m + 1]]
            else:
                leaf, x = self._take_activation(posted[m], sizes[m])
            with _Phase(self.timer, "forward"):
                y = self.module(x)
            if self.is_last:
                with _Phase(self.timer, "forward"):
                    loss = self.loss_fn(y, targets[bounds[m]:bounds[m + 1]]) * (sizes[m] / batch)
                losses.append(float(loss.detach()))
                outputs[m] = loss
            else:
                self._learn_out_shape(y)
                if self.steps < self.warmup_steps:
                    self._remember_for_pca(y)
                outputs[m] = self._send_activation(y, rows[m], False)
                if self.schedule == "1f1b":  # gradients come back in forward order
                    post_grad(m)
            leaves[m] = leaf

        def post_grad(m: int) -> None:
            # The k-th gradient received matches the k-th one the next stage sends, so receives
            # are posted in the order of its backward passes.
            if not self.is_last:
                grad_posted[m] = self._recv(self._from_next, self.next, "grad",
                                            self.out_boundary.index, tuple(outputs[m].shape),
                                            self._backward_codec(self.out_boundary))

        def backward(m: int) -> None:
            if self.is_last:
                with _Phase(self.timer, "backward"):
                    outputs[m].backward()
            else:
                grad, handle = grad_posted[m]
                self._wait(handle, "gradient")
                with _Phase(self.timer, "backward"):
                    torch.autograd.backward(outputs[m], grad)
            if leaves[m] is not None:
                self._send(self._to_prev, self.prev, "grad", self.in_boundary.index,
                           leaves[m].grad, self._backward_codec(self.in_boundary))
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
        self._finish_sends()
        self.steps += 1
        self._calls += 1
        self.step_seconds.append(time.perf_counter() - started)
        self.timer.add("step", self.step_seconds[-1], time.thread_time() - started_cpu)
        return sum(losses) if self.is_last else None

    def _backward_codec(self, boundary: _Boundary) -> str:
        return boundary.backward if self._compressing(boundary) else "none"

    def _allreduce_replicas(self) -> None:
        if self._engine is None:
            return
        with _Phase(self.timer, "replicas"):
            items = []
            for name, p in self.named_parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                items.append((name, p.grad, terse.AllreduceOptions(codec=self.replica_codec)))
            items.sort(key=lambda item: item[0])
            self._engine.allreduce_group(items).wait()

    def _finish_sends(self) -> None:
        handles, self._pending_sends = self._pending_sends, []
        for h in handles:
            self._wait(h, "send")

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
        batch, _, _ = self._header(batch, None, True)
        M = min(self.micro_batches, batch)
        sizes = [len(c) for c in torch.arange(batch).tensor_split(M)]
        bounds = [sum(sizes[:m]) for m in range(M + 1)]
        if self.in_boundary is not None:
            posted = self._post_activation_recvs(sizes, [None] * M, True)
        outs = []
        for m in range(M):
            if self.is_first:
                x = inputs[bounds[m]:bounds[m + 1]]
            else:
                _, x = self._take_activation(posted[m], sizes[m])
            y = self.module(x)
            if self.is_last:
                outs.append(y)
            else:
                self._learn_out_shape(y)
                self._send_activation(y, None, True)
        self._finish_sends()
        self._calls += 1
        return torch.cat(outs) if self.is_last else None

    # ---- measurements -------------------------------------------------------------------------

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank sent through its channels (codec headers included)."""
        return sum(c.bytes_sent for c in self._channels if not c.closed)

    def measure(self, name: str) -> Any:
        """A context manager adding the wall and CPU time of a block to this stage's profile
        under name (e.g. "optimizer", which the cost model counts as per-step work)."""
        return _Phase(self.timer, name)

    def reset_profile(self) -> None:
        """Starts a new measurement window for :meth:`profile` (e.g. after warm-up steps)."""
        self.timer = _Timer()
        self.step_seconds = []
        self.bytes_by_message = {}

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
            self._finish_sends()
        finally:
            for c in self._channels:
                c.close()
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
