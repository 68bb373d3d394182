"""PyTorch integration: a DistributedDataParallel communication hook backed by terse.

Pipeline parallelism with compressed stage boundaries is :func:`pipeline` (from
:mod:`terse.pipeline`). Two lines turn DDP's allreduce into terse's compression-aware one::

    state, hook = terse.torch.ddp_hook(model, codec="powersgd")
    model.register_comm_hook(state, hook)

Each DDP bucket becomes one terse submission (``Engine.allreduce_group``) of its per-parameter
gradients: parameters smaller than ``min_bytes`` travel raw (fp32) and fused into one message,
larger ones are compressed with ``codec``. Results are averaged in place in the bucket,
bit-identical on every rank, and the hook's future completes from the engine's completion
callback.

The hook state (error-feedback residuals, PowerSGD's Q, step counters) is keyed by parameter
name, so it survives DDP's bucket rebuilds, and ``state.state_dict()`` /
``state.load_state_dict()`` make it part of a checkpoint: a resumed run continues bit for bit.

It runs wherever DDP's C++ reducer calls bucket hooks: eager DDP, ``torch.compile`` of a DDP
model (``torch._dynamo.config.optimize_ddp`` True, the default DDPOptimizer, or False),
``no_sync()`` gradient accumulation, ``static_graph=True``, ``gradient_as_bucket_view=True``
and uneven inputs under ``torch.distributed.algorithms.Join``. DDP's Python reducer
(``optimize_ddp="python_reducer"``, the mode compiled autograd needs) calls hooks per gradient
and drops their futures; :func:`ddp_hook` refuses such a model.

Gradients in float16 or bfloat16 (a model cast with ``model.to(torch.bfloat16)``: DDP's bucket
then has the parameters' dtype) are reduced in place in their own dtype: each partition is
summed and decoded in fp32 scratch and rounded once, the same on every rank; raw parameters
travel in the bucket's own precision (terse's summable ring of fp16 or bf16), as DDP sends them.
CPU autocast with fp32 master weights keeps fp32 gradients and the fp32 path.
"""

import hashlib
import itertools
import math
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

import terse
from terse.accordion import Accordion, SparseWarmup
from terse.pipeline import Autoencoder, Delta, Pipeline, pipeline
from terse.policy import AUTO_TIERS as _AUTO, HOOK

__all__ = ["TerseHookState", "ddp_hook", "hook", "check_parameter", "check_agreement",
           "communicator_for",
           "pipeline", "Pipeline", "Autoencoder", "Delta"]

# Communicators created by this process, numbered in creation order. Every rank creates its
# hooks in the same order, so the n-th one gets the same store prefix on every rank.
_communicator_ids = itertools.count()

# What the hook reduces; every other dtype is refused with this list in the message.
_HOOK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Every parameter's options during warm-up: terse's raw fp32 allreduce.
_RAW = terse.Policy.raw_options()


def check_parameter(name: str, param: torch.Tensor) -> None:
    """Raises if the hook cannot reduce the gradient of ``param`` (named ``name``): it must be a
    dense CPU tensor of a dtype in ``_HOOK_DTYPES``. :func:`ddp_hook` checks every trainable
    parameter of the model it is given before it connects, and the hook checks each bucket."""
    if param.layout != torch.strided:
        raise terse.InvalidArgument(
            f"terse.torch: parameter '{name}' has a {param.layout} gradient; the hook reduces "
            "dense gradients only (e.g. nn.Embedding(sparse=False))")
    if param.device.type != "cpu":
        raise terse.InvalidArgument(
            f"terse.torch: parameter '{name}' is on {param.device}; the hook reduces CPU tensors "
            "only (train with the Gloo backend on CPU)")
    if param.dtype not in _HOOK_DTYPES:
        supported = ", ".join(str(d) for d in _HOOK_DTYPES)
        raise TypeError(
            f"terse.torch: parameter '{name}' is {param.dtype}; the hook reduces {supported} "
            "parameters (convert the model, e.g. model.float() or model.bfloat16())")


def _hashes(text: str, ranks: int) -> Tuple[int, int]:
    """Two digests of ``text`` small enough that their sums over ``ranks`` ranks stay below
    2^24, exact in fp32."""
    digest = hashlib.sha256(text.encode()).digest()
    mask = (1 << max(8, 24 - max(ranks - 1, 1).bit_length())) - 1
    return (int.from_bytes(digest[:4], "little") & mask,
            int.from_bytes(digest[4:8], "little") & mask)


def check_agreement(engine: terse.Engine, settings: Dict[str, Any], who: str,
                    what: str) -> None:
    """Raises MismatchError on every rank, naming the first of ``settings`` (name: value, in the
    order a mismatch names them) that differs, unless every rank of ``engine`` has the same:
    an exact sum across ranks of two digests per setting (20 bits each up to 16 ranks). ``who``
    names the front end ("terse.optim.OneBitAdam") and ``what`` the thing every rank must
    construct alike ("optimizer"). A collective: every rank calls it at the same point."""
    keys = list(settings)
    local = torch.tensor([h for k in keys for h in _hashes(f"{k}={settings[k]!r}", engine.size)],
                         dtype=torch.float32)
    total = local.clone()
    who = f"rank {engine.rank}: {who}"
    try:
        engine.allreduce(f"{who.split(': ', 1)[1]} settings {len(keys)}", total, codec="none",
                         average=False).wait()
    except terse.MismatchError as e:
        raise terse.MismatchError(
            f"{who}: the ranks' settings differ (their number); every rank must construct the "
            f"{what} alike. {e}") from e
    differs = (total != local * engine.size).tolist()
    for i, key in enumerate(keys):
        if differs[2 * i] or differs[2 * i + 1]:
            raise terse.MismatchError(
                f"{who}: setting '{key}' differs across ranks (this rank has "
                f"{settings[key]!r}); every rank must construct the {what} alike")


def _sparse_parameters(module: torch.nn.Module) -> List[str]:
    """Names of the parameters DDP gives sparse gradients (as DDP decides: sparse embeddings)."""
    return [f"{prefix}.{name}" if prefix else name
            for prefix, m in module.named_modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
            for name, p in m.named_parameters(recurse=False) if p.requires_grad]


_PYTHON_REDUCER = (
    "DDP runs its Python reducer (torch._dynamo.config.optimize_ddp = {mode!r}, the mode "
    "compiled autograd needs): it calls comm hooks once per gradient and drops their futures, so "
    "the terse hook cannot run there. Use optimize_ddp=True (DDPOptimizer, the default) or "
    "False, without compiled autograd")


def communicator_for(
    process_group: Optional[Any] = None,
    timeout: Optional[float] = None,
    prefix: Optional[str] = None,
) -> terse.Communicator:
    """A terse Communicator over the ranks of a torch.distributed process group.

    With torch.distributed initialized, terse rendezvouses through the default process group's
    store (a TCPStore under torchrun or ``init_method="env://"``, a FileStore with
    ``file://``), under a ``PrefixStore("terse", ...)``, so no extra port or file is needed.
    Without it, it bootstraps from the environment: ``TERSE_FILE_STORE`` (a directory) or
    torchrun's ``MASTER_ADDR``/``MASTER_PORT``, with ``RANK`` and ``WORLD_SIZE``.

    This is a collective: every rank of the group calls it, in the same order relative to other
    terse communicators. ``prefix`` names the communicator's keys in the store; by default the
    n-th communicator of the process is ``"comm-n"``, the same on every rank.
    """
    if prefix is None:
        prefix = f"comm-{next(_communicator_ids)}"
    if dist.is_available() and dist.is_initialized():
        group = process_group if process_group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        size = dist.get_world_size(group)
        if rank < 0:
            raise terse.InvalidArgument(
                f"rank {dist.get_rank()} is not a member of the process group it was given")
        if group is not dist.group.WORLD:
            # Groups over different ranks may both be the n-th of their members: name the ranks.
            ranks = sorted(dist.distributed_c10d._pg_group_ranks[group].keys())
            prefix = f"{prefix}-ranks-{'-'.join(map(str, ranks))}"
        store = dist.PrefixStore("terse", dist.distributed_c10d._get_default_store())
        return terse.Communicator(rank, size, terse.python_store(store), timeout=timeout,
                                  prefix=prefix)
    if process_group is not None:
        raise terse.InvalidArgument("process_group given but torch.distributed is not initialized")
    if not (os.environ.get("TERSE_FILE_STORE") or os.environ.get("MASTER_ADDR")):
        raise terse.InvalidArgument(
            "terse.torch: no way to find the other ranks: call "
            "torch.distributed.init_process_group() first, or run under torchrun / `terse run` "
            "(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), or set TERSE_FILE_STORE")
    return terse.Communicator.from_env(timeout=timeout, prefix=prefix)


class TerseHookState:
    """State of the terse DDP communication hook; create it with :func:`ddp_hook`.

    Knobs (every rank must use the same values; the engine checks the plan of each tensor
    across ranks on first use and raises :class:`terse.MismatchError` otherwise):

    codec
        Codec spec for parameters of at least ``min_bytes``, or a schedule of specs:
        :class:`terse.Accordion` (two levels of one codec family, chosen per tensor at each
        window's end) or :class:`terse.SparseWarmup` (a sparsifier's density ramped down over
        the first windows); see :mod:`terse.accordion`. A schedule counts windows in epochs
        (call :meth:`epoch_end` at the end of each, on every rank) or in steps; see also
        :meth:`watch` and :meth:`lr_changed`. The default, ``"powersgd:rank=8"`` (with its
        built-in error feedback, the gradient viewed as ``param.shape[0]`` rows), sends about 2%
        of the fp32 bytes of an MLP's weights and kept DDP's test accuracy within 0.3 points on
        the training benchmark's MLP and CNN and in the demo (docs/training.md); rank 4
        (``"powersgd"``) sends half that and lost 2 points in a short run. Others: ``"fp16"``,
        ``"bf16"``, ``"onebit:ef=1"`` (1 bit per element with error feedback),
        ``"qsgd:levels=16"``; ``terse.codec_names()`` lists them and
        ``terse.canonical_spec(spec)`` shows every parameter. ``"none"`` reduces raw fp32
        (terse's ring; equal to DDP's own allreduce up to summation order). ``"auto"`` leaves
        the choice to the engine's planner among the codecs that keep accuracy (the light tier,
        ``auto_codecs``), ``"auto:heavy"`` among those and the ones that compress more (the
        heavy tier, ``heavy_codecs``); ``terse.Accordion("auto:heavy", "auto")`` switches each
        parameter between the two. The planner calibrates when the hook is created
        (``Engine.calibrate``: a collective of a few seconds, skipped when every rank holds the
        same cached calibration).
    auto_codecs
        With codec ``"auto"`` (or ``"auto:heavy"``, or an Accordion over them): the light tier,
        the codecs the planner may choose from for each parameter (lossy codecs change what
        training computes, so this is yours to decide), e.g. ``["fp16", "powersgd"]``. None:
        ``TERSE_PLAN_CODECS``, else the planner's light tier (docs/planner.md lists it: the
        codecs that kept DDP's accuracy on the training benchmark; PowerSGD views each weight's
        gradient as ``param.shape[0]`` rows, with ``matrix_view``). ``["none"]``: raw only.
    heavy_codecs
        With codec ``"auto:heavy"`` (or an Accordion over auto): the heavy tier, the codecs the
        planner may choose from as well, e.g. ``["onebit:ef=1"]``. None:
        ``TERSE_PLAN_HEAVY_CODECS``, else the planner's heavy tier (docs/planner.md).
        ``["none"]``: none.
    adaptive
        True when the model trains with an adaptive optimizer (Adam, AdamW and their family):
        the tiers left as None are ``terse.policy.ADAPTIVE_TIERS`` (light: fp16 and minmax8
        with error feedback; PowerSGD moves to the heavy tier), since Adam divides each
        element's step by its own gradient's RMS and so magnifies the errors low rank spreads
        over a matrix (docs/planner.md, "Under Adam").
    strategy
        How compressed tensors are reduced: ``"auto"`` (the engine's choice for the codec:
        summable codecs such as fp16 and PowerSGD ride a ring on compressed data, DGC's
        payloads are gathered, others use ``"sharded"``), ``"allgather"``, ``"sharded"``,
        ``"ring"`` or ``"summable"``.
        PowerSGD takes ``"summable"`` (its rounds' sums on rings) or ``"allgather"`` (gathered:
        one message step a round, for latency-bound links).
    partitions
        Pieces each compressed tensor is split into so that encoding one overlaps sending
        another; 0 lets the engine choose from the size (about 8 MiB per piece).
    min_bytes
        Parameters whose gradient is smaller than this (in its own dtype's bytes) travel
        uncompressed. Biases and norms
        gain nothing from compression and are fused into one raw message per bucket; the
        default, 64 KiB, keeps every weight matrix of a typical MLP or CNN compressed.
    clip_norm
        Local gradient clipping (DGC's): before it is compressed, each compressed parameter's
        local gradient is scaled down to norm ``clip_norm / sqrt(ranks)`` if it is longer, so
        that error-feedback accumulators and DGC's velocity cannot grow from one outlier. Per
        parameter, not over the whole model (the hook sees one bucket at a time). None: off.
    warmup_steps
        The first ``warmup_steps`` communicated steps reduce raw fp32 through terse (codec
        ``"none"`` for every parameter, whatever ``codec`` says: plain allreduce, as PowerSGD's
        ``start_powerSGD_iter``); compression starts at step ``warmup_steps``, with fresh
        error-feedback and codec state. A step is one DDP iteration that communicates (the
        last bucket's hook ends it), so ``no_sync()`` micro-batches do not count. The count is
        part of :meth:`state_dict`, so a resumed run switches at the same step.
    matrix_view
        For PowerSGD without an explicit ``rows=``, named or chosen by codec ``"auto"``: view
        each gradient as a matrix of ``param.shape[0]`` rows (as PyTorch's PowerSGD hook does)
        rather than the most nearly square factorization of its size.
    seed
        Seed of stochastic codecs (qsgd, terngrad, natural, ...); the same on every rank.
    threads
        Engine worker threads that run encode and decode (0: ``TERSE_THREADS``, else 4). With
        several ranks per machine, cores / ranks is a good choice.
    fuse_bytes, partition_bytes
        Raw tensors of a bucket up to ``fuse_bytes`` share one message; ``partition_bytes`` is
        the target piece size when ``partitions`` is 0.
    gather_bytes
        A raw message whose copies for the other ranks, ``(ranks - 1) * 4 * elements`` bytes,
        fit in ``gather_bytes`` is sent whole to every rank (one message step) instead of
        around the ring (``2 (ranks - 1)`` steps): more bytes, fewer latencies.
    keep_input_on_error
        Stage results so that a failed allreduce leaves the gradients unchanged (one more copy).
    timeout
        Seconds every wait is bounded by (None: ``TERSE_TIMEOUT``, else 60). A dead or stalled
        rank makes every other rank's backward raise within about this time, naming the tensor
        and the peer, instead of hanging.
    process_group
        The DDP model's process group (None: the default group). terse connects its own Gloo
        TCP mesh over the same ranks, bootstrapped through the default group's store.
    lazy
        Validate the knobs (and the model, if given) now, connect later: at :meth:`connect`
        or at the first bucket the hook reduces. For trainers that create the state before the
        process group exists or wrap the model in DDP themselves (:mod:`terse.lightning`,
        :mod:`terse.hf`). Codec ``"auto"`` then calibrates when it connects, which at the first
        bucket is inside the first backward. Until then ``engine`` is None, ``bytes_sent`` 0,
        and :meth:`plan`, :meth:`state_dict` and :meth:`load_state_dict` raise.

    ``codec``, ``min_bytes``, ``strategy``, ``partitions``, ``auto_codecs``, ``heavy_codecs``
    and ``adaptive`` make the hook's :class:`terse.Policy` (validated before connecting, shared
    with the other front ends); ``state.policy`` is it, and the knobs are its attributes too.

    Attributes: ``engine`` (the :class:`terse.Engine`; ``engine.options`` are the
    :class:`terse.EngineOptions` it runs with), ``policy``, ``error`` (the first terse error the hook met,
    with its type: DDP re-raises hook failures as RuntimeError carrying the same text),
    ``bytes_sent`` (bytes this rank has sent), ``steps`` (communicated steps: DDP iterations
    whose gradients the hook reduced, counted when the last bucket is submitted; ``no_sync()``
    iterations do not count, a rank that has joined under ``Join`` counts the steps it shadows),
    ``buckets`` (buckets submitted).

    Where it runs: see the module's docstring. Limits: dense float32 CPU parameters only
    (:func:`check_parameter` says what a parameter lacks); averages divide by the world size,
    as DDP does under ``Join`` with ``divide_by_initial_world_size=True`` (its default), so
    ``divide_by_initial_world_size=False`` is not honoured; every rank must hold the same
    parameters under the same names (the engine checks each bucket on first use and raises
    :class:`terse.MismatchError` on every rank, listing both sides).
    """

    def __init__(
        self,
        model: Optional[torch.nn.Module] = None,
        *,
        codec: Union[str, Accordion, SparseWarmup] = "powersgd:rank=8",
        auto_codecs: Optional[Sequence[str]] = None,
        heavy_codecs: Optional[Sequence[str]] = None,
        strategy: str = "auto",
        partitions: int = 0,
        min_bytes: int = 64 << 10,
        warmup_steps: int = 0,
        clip_norm: Optional[float] = None,
        matrix_view: bool = True,
        seed: int = 0,
        threads: int = 0,
        fuse_bytes: int = 1 << 20,
        partition_bytes: int = 8 << 20,
        gather_bytes: int = 16 << 10,
        keep_input_on_error: bool = False,
        timeout: Optional[float] = None,
        process_group: Optional[Any] = None,
        communicator: Optional[terse.Communicator] = None,
        lazy: bool = False,
        adaptive: bool = False,
    ) -> None:
        if warmup_steps < 0:
            raise terse.InvalidArgument(f"warmup_steps must be >= 0, not {warmup_steps}")
        if clip_norm is not None and not clip_norm > 0:
            raise terse.InvalidArgument(f"clip_norm must be > 0 (or None), not {clip_norm}")
        # Validated before any rank connects: a typo fails fast, on this rank alone.
        self.policy = terse.Policy(codec, min_bytes=min_bytes, strategy=strategy,
                                   partitions=partitions, auto_codecs=auto_codecs,
                                   heavy_codecs=heavy_codecs, door=HOOK, adaptive=adaptive)
        self.clip_norm = clip_norm
        self.warmup_steps = warmup_steps
        self.matrix_view = matrix_view

        self._names: Dict[int, str] = {}
        if model is not None:
            self._adopt(model)
        self._options: Dict[str, terse.AllreduceOptions] = {}  # each parameter's, this step
        self._level_options: Dict[Tuple[str, str], terse.AllreduceOptions] = {}
        self._raw: Dict[str, bool] = {}  # parameters below min_bytes
        self._elements: Dict[str, int] = {}
        self._dtypes: Dict[str, torch.dtype] = {}
        self.error: Optional[BaseException] = None
        self.steps = 0
        self.buckets = 0
        # The schedule's windows: each compressed parameter's gradient summed over the window
        # (Accordion), steps into the window, whether it ended (decided at the next step's start).
        self._accumulated: Dict[str, torch.Tensor] = {}
        self._window_steps_done = 0
        self._window_ended = False
        self._lr_dropped = False
        self._in_step = False
        self._schedule_checked = False
        self._optimizer: Optional[Any] = None
        self._lrs: List[float] = []

        # Checked now, made when connecting: a state that has not connected pickles (Lightning's
        # ddp_spawn sends callbacks to its ranks).
        self._engine_knobs = dict(
            seed=seed, threads=threads, fuse_bytes=fuse_bytes, partition_bytes=partition_bytes,
            gather_bytes=gather_bytes, keep_input_on_error=keep_input_on_error)
        self.policy.engine_options(**self._engine_knobs)
        self._communicator = communicator
        self._process_group = process_group
        self._timeout = timeout
        self.engine: Optional[terse.Engine] = None
        # terse.elastic: a peer's failure leaves the gradients as they are (the step is dropped
        # on every member alike at its commit) instead of failing the backward.
        self._absorb_peer_failures = False
        if not lazy:
            self.connect()

    def _adopt(self, model: torch.nn.Module) -> None:
        """Takes the parameter names of ``model`` and checks, on this rank before connecting,
        what the hook could never reduce."""
        if getattr(model, "_use_python_reducer", False):  # torch 2.x only
            raise terse.InvalidArgument(
                _PYTHON_REDUCER.format(mode=torch._dynamo.config.optimize_ddp))
        module = getattr(model, "module", model)  # DDP wraps the user's module
        sparse = _sparse_parameters(module)
        if sparse:
            raise terse.InvalidArgument(
                f"terse.torch: parameter '{sparse[0]}' gets sparse gradients (a sparse "
                "embedding); the hook reduces dense gradients only: use sparse=False")
        for name, p in module.named_parameters():
            if p.requires_grad:
                check_parameter(name, p)
        self._names = {id(p): name for name, p in module.named_parameters()}

    @property
    def connected(self) -> bool:
        """Whether the state holds its engine (a ``lazy=True`` state connects later)."""
        return self.engine is not None

    def connect(self, model: Optional[torch.nn.Module] = None) -> None:
        """Connects terse's Gloo mesh over the process group and makes the engine (with codec
        ``"auto"``, also calibrates). A collective: every rank calls it, after
        ``torch.distributed.init_process_group``. The constructor does it unless ``lazy=True``;
        a lazy state does it at its first bucket unless called before (every rank reaches its
        first backward, so the collective is safe there). ``model`` (the DDP model or the
        module it wraps) names the parameters if the constructor was given none. Does nothing
        once connected."""
        if self.engine is not None:
            return
        if model is not None and not self._names:
            self._adopt(model)
        comm = self._communicator if self._communicator is not None else communicator_for(
            self._process_group, timeout=self._timeout)
        engine = terse.Engine(comm, self.policy.engine_options(**self._engine_knobs))
        self.policy.calibrate(engine)
        self.engine = engine

    def _reconnect(self, communicator: terse.Communicator) -> None:
        """terse.elastic, after the members changed: closes the engine (its codec and
        error-feedback state go with it, on every member alike) and makes a new one over
        ``communicator``. Not a collective by itself; every member calls it after re-forming."""
        if self.engine is not None:
            try:
                self.engine.close()
            except terse.Error:
                pass  # a failed engine's pending work ends with errors, already recorded
            self.engine = None
        self._communicator = communicator
        self.error = None
        self._in_step = False
        self._accumulated.clear()
        self.connect()

    def _peer_failure(self, error: BaseException) -> bool:
        """Whether ``error`` is absorbed: a dead or stalled peer under terse.elastic."""
        return self._absorb_peer_failures and isinstance(error, (terse.TransportError,
                                                                 terse.TimeoutError))

    def _engine_or_raise(self, what: str) -> terse.Engine:
        if self.engine is None:
            raise terse.InvalidArgument(
                f"terse.torch: {what} needs the hook state's engine, and this lazy state has "
                "not connected yet: call state.connect() on every rank first (or train a step)")
        return self.engine

    # The policy's knobs, as given (terse.Policy).
    codec = property(lambda self: self.policy.codec)
    schedule = property(lambda self: self.policy.schedule)
    strategy = property(lambda self: self.policy.strategy)
    partitions = property(lambda self: self.policy.partitions)
    min_bytes = property(lambda self: self.policy.min_bytes)
    auto_codecs = property(lambda self: self.policy.auto_codecs)
    heavy_codecs = property(lambda self: self.policy.heavy_codecs)

    # ---- what each parameter gets ------------------------------------------------------------

    def _name(self, param: torch.Tensor) -> str:
        name = self._names.get(id(param))
        if name is None:
            # No model given: number parameters in the order the hook first sees them. DDP
            # buckets every parameter in the first iteration, in the same order on every rank
            # and in every run of the same model, so the numbers are stable.
            name = f"param{len(self._names)}{list(param.shape)}"
            self._names[id(param)] = name
        return name

    def _options_for(self, name: str, param: torch.Tensor) -> terse.AllreduceOptions:
        raw = self._raw.get(name)
        if raw is None:
            self._elements[name] = param.numel()
            self._dtypes[name] = param.dtype
            raw = self._raw[name] = not self.policy.compresses(
                param.numel() * param.element_size())
        if raw:
            options = self._options.get(name)
            if options is None:
                options = self._options[name] = self.policy.raw_options()
            return options
        codec = self.policy.spec_for(name)
        options = self._level_options.get((name, codec))
        if options is None:
            spec = codec
            rows = 0
            if spec in _AUTO:
                # A matrix codec the planner chooses views the gradient as a fixed one would.
                if self.matrix_view and param.dim() >= 2:
                    rows = param.shape[0]
            elif spec.split(":")[0] == "powersgd":
                # An explicit rows= stays. A schedule's specs are canonical, where rows=0 (most
                # nearly square) is the default rather than a choice.
                explicit = "rows=" in spec if self.schedule is None else [
                    kv for kv in spec.partition(":")[2].split(",")
                    if kv.startswith("rows=") and kv != "rows=0"]
                if self.matrix_view and param.dim() >= 2 and not explicit:
                    spec = ",".join(kv for kv in spec.split(",") if kv != "rows=0")
                    spec += ("," if ":" in spec else ":") + f"rows={param.shape[0]}"
            options = self.policy.compressed_options(spec, rows=rows)
            self._level_options[(name, codec)] = options
        self._options[name] = options
        return options

    def plan(self) -> List[Tuple[str, int, terse.TensorPlan]]:
        """(name, elements, plan) of every parameter the hook has seen: what travels how (after
        warm-up; during it, everything travels raw; under a schedule, at the latest step)."""
        engine = self._engine_or_raise("plan()")
        return [(name, self._elements[name],
                 engine.plan(self._elements[name], codec=options.codec,
                             strategy=options.strategy, partitions=options.partitions,
                             dtype=self._dtypes[name], rows=options.rows))
                for name, options in self._options.items()]

    # ---- the hook ----------------------------------------------------------------------------

    def _record(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def _items(self, bucket: dist.GradBucket) -> List[Tuple[str, torch.Tensor,
                                                            terse.AllreduceOptions]]:
        """(name, gradient, options) of each parameter of a bucket; raises for what the hook
        cannot reduce, on every rank alike (they hold the same model), so none waits."""
        if not isinstance(bucket, dist.GradBucket):
            # DDP's Python reducer calls hooks with a (gradient, parameter) pair.
            raise terse.InvalidArgument(
                _PYTHON_REDUCER.format(mode=torch._dynamo.config.optimize_ddp))
        params = bucket.parameters()
        if bucket.buffer().layout != torch.strided:
            # DDP gives a sparse gradient a bucket of its own, with no dense views in it.
            name = self._name(params[0]) if params else "?"
            raise terse.InvalidArgument(
                f"terse.torch: parameter '{name}' has a {bucket.buffer().layout} gradient; the "
                "hook reduces dense gradients only (e.g. nn.Embedding(sparse=False))")
        warming_up = self.steps < self.warmup_steps
        accumulate = self.schedule is not None and self.schedule.needs_norms
        items = []
        for param, grad in zip(params, bucket.gradients()):
            name = self._name(param)
            check_parameter(name, grad)
            options = self._options_for(name, param)
            if not self._raw[name]:
                if self.clip_norm is not None:
                    norm = float(grad.norm())
                    limit = self.clip_norm / math.sqrt(self.engine.size)
                    if norm > limit:
                        grad.mul_(limit / norm)
                if accumulate:
                    total = self._accumulated.get(name)
                    if total is None:
                        self._accumulated[name] = grad.detach().to(torch.float32, copy=True)
                    else:
                        total.add_(grad)
            items.append((name, grad, _RAW if warming_up else options))
        return items

    # ---- schedules (terse.Accordion, terse.SparseWarmup) -------------------------------------

    def epoch_end(self) -> None:
        """Ends the schedule's window when its windows are epochs (``window_steps=None``); call
        it after each epoch's last step, on every rank. The next communicated step decides the
        new levels (Accordion: one raw allreduce of a float per compressed parameter). Without
        a schedule, or with windows of ``window_steps``, it does nothing."""
        if (self.schedule is not None and self.schedule.window_steps is None
                and self._window_steps_done > 0):
            self._window_ended = True

    def lr_changed(self) -> None:
        """Tells the schedule that the learning rate dropped: under :class:`terse.Accordion`
        every parameter uses the light level from the next step until the window ends. Call it
        on every rank at the same point (or let :meth:`watch` read the optimizer)."""
        self._lr_dropped = True

    def watch(self, optimizer: Any) -> None:
        """Reads ``optimizer``'s learning rates at the start of every communicated step: a drop
        in any parameter group counts as :meth:`lr_changed`."""
        self._optimizer = optimizer
        self._lrs = self._read_lrs()

    def _read_lrs(self) -> List[float]:
        return [float(group["lr"]) for group in self._optimizer.param_groups]

    def _begin_step(self) -> None:
        """At the first bucket of a communicated step: the schedule's checks and decisions, at
        the same point on every rank."""
        if self.schedule is None:
            return
        if not self._schedule_checked:
            self._check_schedule()
            self._schedule_checked = True
        if self._optimizer is not None:
            lrs = self._read_lrs()
            if len(lrs) == len(self._lrs) and any(a < b for a, b in zip(lrs, self._lrs)):
                self._lr_dropped = True
            self._lrs = lrs
        if self._window_ended:
            self._end_window()
        if self._lr_dropped:
            self.schedule.lr_dropped()
            self._lr_dropped = False

    def _check_schedule(self) -> None:
        """Fails on every rank, naming both sides, if the ranks' schedules differ: the engine's
        first-use check compares the names of a one-float allreduce across ranks."""
        try:
            self.engine.allreduce(f"terse schedule {self.schedule.describe()}",
                                  torch.zeros(1), codec="none").wait()
        except terse.MismatchError as e:
            raise terse.MismatchError(
                f"rank {self.engine.rank}: the hook's codec schedules differ across ranks; every "
                f"rank must give the same one. {e}") from e

    def _end_window(self) -> None:
        norms: Dict[str, float] = {}
        if self.schedule.needs_norms and self._accumulated:
            names = sorted(self._accumulated)
            local = torch.tensor([float(self._accumulated[n].norm()) for n in names],
                                 dtype=torch.float32)
            # The ranks' mean, bit-identical everywhere: every rank decides alike.
            self.engine.allreduce("terse schedule norms", local, codec="none").wait()
            norms = dict(zip(names, local.tolist()))
            for total in self._accumulated.values():
                total.zero_()
        self.schedule.end_window(norms)
        self._window_ended = False
        self._window_steps_done = 0

    def _end_step(self) -> None:
        self._in_step = False
        if self.schedule is None:
            return
        self._window_steps_done += 1
        window = self.schedule.window_steps
        if window is not None and self._window_steps_done >= window:
            self._window_ended = True

    def submit(self, bucket: dist.GradBucket) -> "torch.futures.Future[torch.Tensor]":
        """Starts the allreduce of one bucket; the future completes with the averaged buffer."""
        try:
            if self.engine is None:
                self.connect()
            if not self._in_step:
                self._begin_step()
                self._in_step = True
            items = self._items(bucket)
        except BaseException as e:
            self._record(e)
            raise
        # Submit in name order: the layout of the fused raw message, and with it the order in
        # which each element is summed across 3 or more ranks, then depends on which tensors
        # share the bucket and not on their order in it, which changes when DDP rebuilds its
        # buckets after the first iteration (a resumed run would otherwise differ in the last bit).
        items.sort(key=lambda item: item[0])
        buffer = bucket.buffer()
        try:
            handle = self.engine.allreduce_group(items)
        except BaseException as e:
            self._record(e)
            if self._peer_failure(e):
                absorbed: torch.futures.Future[torch.Tensor] = torch.futures.Future()
                absorbed.set_result(buffer)
                return absorbed
            raise
        self.buckets += 1
        if bucket.is_last():  # DDP runs bucket hooks in index order
            self.steps += 1
            self._end_step()

        # DDP reads the returned future from C++, which sees an error only when a then()
        # callback raised; Future.set_exception() alone would reach it as a value of the wrong
        # type. So the engine's callback completes `done` with the buffer or the error object,
        # and the future DDP gets raises the error from there.
        done: torch.futures.Future[Any] = torch.futures.Future()

        def complete(error: Optional[BaseException]) -> None:
            if error is not None:
                self._record(error)
                if self._peer_failure(error):
                    error = None
            done.set_result(buffer if error is None else error)

        handle.on_complete(complete)
        return done.then(_unwrap)

    # ---- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The hook's state for a checkpoint: per-parameter error-feedback residuals, codec
        state (PowerSGD's Q), step counters (which key stochastic codecs' random streams) and the
        hook's count of communicated steps (where warm-up ends). Save it with the model and
        optimizer after ``optimizer.step()``; every rank saves its own (residuals differ per
        rank). Under a schedule, also its decisions, its window's progress and (Accordion) this
        rank's gradient sums over the current window."""
        self._engine_or_raise("state_dict()").synchronize()
        return {
            **self.policy.state_dict(rank=self.engine.rank, size=self.engine.size),
            "schedule": None if self.schedule is None else self.schedule.state_dict(),
            "window": {"steps": self._window_steps_done, "ended": self._window_ended,
                       "lr_dropped": self._lr_dropped, "lrs": list(self._lrs),
                       "accumulated": {k: v.clone() for k, v in self._accumulated.items()}},
            "warmup_steps": self.warmup_steps,
            "steps": self.steps,
            "engine": self.engine.save_state(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output (from the same rank of a job of the same size and
        configuration), so that training continues bit for bit."""
        self._engine_or_raise("load_state_dict()")
        # A checkpoint of a hook without warm-up counts as warmup_steps=0.
        self.policy.load_state_dict(state, rank=self.engine.rank, size=self.engine.size,
                                    what="terse hook state",
                                    settings={"warmup_steps": self.warmup_steps},
                                    absent={"warmup_steps": 0})
        self.engine.synchronize()
        self.engine.load_state(state["engine"])
        self.steps = int(state.get("steps", 0))
        if self.schedule is not None:
            self.schedule.load_state_dict(state["schedule"])
            window = state["window"]
            self._window_steps_done = int(window["steps"])
            self._window_ended = bool(window["ended"])
            self._lr_dropped = bool(window["lr_dropped"])
            if self._optimizer is not None and window["lrs"]:
                self._lrs = [float(v) for v in window["lrs"]]
            self._accumulated = {k: v.clone() for k, v in window["accumulated"].items()}

    @property
    def bytes_sent(self) -> int:
        return 0 if self.engine is None else self.engine.bytes_sent

    def close(self) -> None:
        """Waits for outstanding allreduces and releases the engine's threads and connections."""
        if self.engine is not None:
            self.engine.close()


def _unwrap(done: "torch.futures.Future[Any]") -> torch.Tensor:
    value = done.value()
    if isinstance(value, BaseException):
        raise value
    return value


# DDP checks these annotations literally, so this module does not use postponed annotations.
def hook(state: TerseHookState,
         bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``model.register_comm_hook(state, hook)``."""
    return state.submit(bucket)


def register_on(state: TerseHookState, ddp: Any, module: Optional[torch.nn.Module], *,
                door: str, needs: str) -> None:
    """Connects ``state`` (naming the parameters of ``module``) and registers its hook on
    ``ddp``, the model a trainer wrapped: the trainers' adapters (:mod:`terse.lightning`,
    :mod:`terse.hf`) call it when training begins. Raises InvalidArgument, saying what ``door``
    ``needs``, when ``ddp`` is not DistributedDataParallel."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        raise terse.InvalidArgument(f"{door} is a {type(ddp).__name__}, not "
                                    f"DistributedDataParallel; the terse hook needs {needs}")
    state.connect(module)
    ddp.register_comm_hook(state, hook)


def ddp_hook(
    model: Optional[torch.nn.Module] = None, **knobs: Any
) -> Tuple[TerseHookState, Callable[[TerseHookState, dist.GradBucket], torch.futures.Future]]:
    """Returns ``(state, hook)`` for ``model.register_comm_hook(state, hook)``.

    ``model`` (the DDP model or the module it wraps) gives tensors their parameter names, used
    in error messages and as keys of the saved state; without it parameters are numbered. The
    keyword arguments are :class:`TerseHookState`'s knobs (``codec``, ``strategy``,
    ``partitions``, ``min_bytes``, ``process_group``, ``timeout``, ...). Call it on every rank
    after ``torch.distributed.init_process_group``; it connects terse's own Gloo mesh (a
    collective, bounded by ``timeout``), or, with ``lazy=True``, at the first bucket.
    """
    return TerseHookState(model, **knobs), hook
