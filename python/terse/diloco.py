"""DiLoCo and Streaming DiLoCo: infrequent, compressed, overlapped synchronization of workers.

Every worker trains its own replica with its own (inner) optimizer for ``sync_every`` (H)
steps; then the workers average the *pseudo-gradient* (the global parameters minus their local
ones) through terse's compressed collectives, an outer optimizer (Nesterov SGD, as published)
moves the global parameters by it, and the workers continue from them::

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = terse.diloco.DiLoCo(model, inner, sync_every=100, codec="minmax8:bits=4,ef=1")
    for x, y in batches:                      # each worker its own data
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()                      # inner step; every H steps the outer one
    optimizer.finish()                        # a last outer step: the model is global

DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(2023). Streaming DiLoCo (Douillard et al., 2025): with ``fragments`` > 1 the parameters are
split into fragments, each synchronized every H steps on its own offset (fragment k at the inner
steps t with t mod H = (k + 1) H / P mod H), so that the bytes of one outer step are spread over
the period; with ``delay`` (tau) > 0 a fragment's exchange runs in the background during the
next tau inner steps and is merged when they are done: ``local = mixing * local + (1 - mixing) *
global``. Pseudo-gradients may be compressed with any codec; with error feedback (``:ef=1``)
what one outer step drops is sent in a later one.

The global parameters are bit-identical on every worker after every outer step (the engine's
results are); with ``delay`` = 0 and ``mixing`` = 0 every worker's model equals them after each
of its fragments' outer steps. A worker is one rank of ``process_group`` (default: the world);
to make a worker of a host's ranks, train them with DDP inside the host and give DiLoCo the
group of the ranks of the same local rank across hosts.
"""

import copy
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

import terse
import terse.torch
from terse.policy import Door

__all__ = ["DiLoCo", "DILOCO", "nesterov"]

# The door of DiLoCo: it plans both tiers of codec "auto" (per pseudo-gradient tensor, from the
# engine's calibration) and takes no schedule.
DILOCO = Door("terse.diloco")
# The version of the checkpoints state_dict() writes.
STATE_VERSION = 1


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise terse.InvalidArgument(f"terse.diloco: {what}")


def nesterov(lr: float = 0.7, momentum: float = 0.9) -> Callable[[List[torch.Tensor]],
                                                                  torch.optim.Optimizer]:
    """The published outer optimizer: SGD with Nesterov momentum (DiLoCo's lr 0.7, momentum
    0.9), as a factory of one optimizer per fragment."""
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum,
                                         nesterov=momentum > 0)


class _Fragment:
    """One fragment: its parameters, their global copies, the flat pseudo-gradient buffer
    (each parameter's a view into it), its outer optimizer and its exchange in flight."""

    def __init__(self, index: int, names: List[str], params: List[torch.Tensor],
                 outer: Callable[[List[torch.Tensor]], torch.optim.Optimizer]) -> None:
        self.index = index
        self.names = names
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.global_params = [p.detach().clone().requires_grad_(True) for p in params]
        self.flat = torch.zeros(self.numel)
        self.views = [v.view_as(p) for v, p in zip(torch.split(self.flat, self.sizes), params)]
        self.outer = outer(self.global_params)
        _check(isinstance(self.outer, torch.optim.Optimizer),
               f"outer_optimizer must return a torch.optim.Optimizer, not {self.outer!r}")
        # The exchange in flight: (handle, step it started at, step it is merged after).
        self.handle: Optional[terse.Handle] = None
        self.started_at = 0
        self.due = 0
        self.nonfinite = torch.zeros(0)
        self.submitted = 0.0
        self.completed: List[float] = []


class DiLoCo:
    """An outer loop around ``model`` and its ``inner`` optimizer (any torch optimizer over the
    model's parameters): see the module's docstring.

    model
        The worker's model (a DDP model or the module it wraps): its trainable parameters are
        synchronized. Dense CPU float32 parameters.
    inner
        The inner optimizer: :meth:`step` steps it, then counts the inner step. Its state stays
        local (as published) and is part of :meth:`state_dict`.
    sync_every
        H, the inner steps between two outer steps of a fragment (>= 1).
    outer_optimizer
        A callable from a list of (global) parameters to a torch optimizer, called once per
        fragment; default :func:`nesterov` (lr 0.7, momentum 0.9, Nesterov).
    fragments
        1 (DiLoCo), a number P <= H of fragments (the parameters in model order, cut into P
        contiguous runs of about equal size), or a list of lists of parameter names that covers
        every trainable parameter once.
    delay
        tau, the inner steps a fragment's exchange may run in the background before it is
        merged (0 <= tau < H; 0: the outer step completes within the step that starts it).
    mixing
        alpha in [0, 1): the share of the local parameters kept when the global ones are merged
        in (0: replaced, as DiLoCo does; Streaming DiLoCo uses 0.5 with tau > 0).
    warmup, warmup_codec
        The first ``warmup`` inner steps are synchronous: :meth:`step` averages the gradients
        over the workers (``warmup_codec``: tensors of at least ``min_bytes`` get it, the rest
        travel raw; default "none", exact) before the inner step, so that every worker takes
        the same steps; the global parameters are then the workers' (identical) parameters and
        the outer steps follow every H steps from there. 0: DiLoCo from the first step.
    codec, min_bytes, strategy, partitions, auto_codecs, heavy_codecs
        The pseudo-gradients' :class:`terse.Policy`: tensors of at least ``min_bytes`` are
        compressed with ``codec`` (``":ef=1"`` for error feedback across outer steps), smaller
        ones travel raw. Default ``"none"``: the exact fp32 average.
    communicator, process_group, timeout, threads
        Where the workers are: a terse Communicator, or one made over ``process_group``
        (:func:`terse.torch.communicator_for`), every wait bounded by ``timeout`` seconds; the
        engine's worker threads (0: its default).

    Every worker must construct it alike (MismatchError on every worker, naming the setting,
    otherwise) and call :meth:`step` the same number of times.
    """

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, *,
                 sync_every: int,
                 outer_optimizer: Optional[Callable[[List[torch.Tensor]],
                                                    torch.optim.Optimizer]] = None,
                 fragments: Union[int, Sequence[Sequence[str]]] = 1, delay: int = 0,
                 mixing: float = 0.0, warmup: int = 0, warmup_codec: str = "none",
                 codec: str = "none", min_bytes: int = 0,
                 strategy: str = "auto", partitions: int = 0,
                 auto_codecs: Optional[Sequence[str]] = None,
                 heavy_codecs: Optional[Sequence[str]] = None,
                 communicator: Optional[terse.Communicator] = None,
                 process_group: Optional[Any] = None, timeout: Optional[float] = None,
                 threads: int = 0) -> None:
        _check(isinstance(sync_every, int) and not isinstance(sync_every, bool)
               and sync_every >= 1, f"sync_every (H) must be an integer >= 1, not {sync_every!r}")
        _check(isinstance(delay, int) and not isinstance(delay, bool)
               and 0 <= delay < sync_every,
               f"delay (tau) must be an integer in [0, sync_every={sync_every}), not {delay!r}")
        _check(isinstance(mixing, (int, float)) and 0.0 <= mixing < 1.0,
               f"mixing (alpha) must be a number in [0, 1), not {mixing!r}")
        _check(isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= 0,
               f"warmup must be an integer >= 0, not {warmup!r}")
        _check(isinstance(inner, torch.optim.Optimizer),
               f"inner must be a torch.optim.Optimizer, not {type(inner).__name__}")
        _check(isinstance(threads, int) and threads >= 0,
               f"threads must be an integer >= 0, not {threads!r}")
        try:
            self.policy = terse.Policy(codec, min_bytes=min_bytes, strategy=strategy,
                                       partitions=partitions, auto_codecs=auto_codecs,
                                       heavy_codecs=heavy_codecs, door=DILOCO)
        except terse.SpecError as e:
            raise terse.InvalidArgument(f"terse.diloco: codec {codec!r}: {e}") from e
        try:
            self.warmup_policy = terse.Policy(warmup_codec, min_bytes=min_bytes,
                                              strategy=strategy, partitions=partitions,
                                              auto_codecs=auto_codecs,
                                              heavy_codecs=heavy_codecs, door=DILOCO)
        except terse.SpecError as e:
            raise terse.InvalidArgument(
                f"terse.diloco: warmup_codec {warmup_codec!r}: {e}") from e
        self.model = model
        self.inner = inner
        self.sync_every = sync_every
        self.delay = delay
        self.mixing = float(mixing)
        self.warmup = warmup
        module = getattr(model, "module", model)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        _check(bool(named), "the model has no trainable parameters")
        for name, p in named:
            if hasattr(p, "_local_tensor") or getattr(p, "_is_flat_param", False):
                raise terse.InvalidArgument(
                    f"terse.diloco: parameter '{name}' is a shard of an FSDP model; DiLoCo "
                    "averages whole replicas of every parameter")
            terse.torch.check_parameter(name, p)
            if p.dtype != torch.float32:
                raise TypeError(f"terse.diloco: parameter '{name}' is {p.dtype}; DiLoCo keeps "
                                "fp32 parameters (model.float(); autocast for the compute)")
        inner_params = {id(p) for g in inner.param_groups for p in g["params"]}
        missing = [n for n, p in named if id(p) not in inner_params]
        _check(not missing, f"the inner optimizer does not update parameter '{missing[0]}'"
               if missing else "")
        self._outer_factory = outer_optimizer or nesterov()
        self.fragments = [_Fragment(k, [n for n, _ in run], [p for _, p in run],
                                    self._outer_factory)
                          for k, run in enumerate(self._split(named, fragments))]
        _check(len(self.fragments) <= sync_every,
               f"{len(self.fragments)} fragments need sync_every >= {len(self.fragments)} (each "
               f"synchronizes once every H = {sync_every} steps on its own offset)")
        self.offsets = [((k + 1) * sync_every // len(self.fragments)) % sync_every
                        for k in range(len(self.fragments))]
        for f in self.fragments:
            f.started_at = warmup
        self.steps = 0
        self.outer_steps = 0
        self._warmed = 0.0  # seconds the warm-up's gradient averages took
        self._waited = 0.0  # seconds step() spent waiting for exchanges
        self._exchanged = 0.0  # seconds from submission to completion, summed
        self._threads = threads
        self.engine: Optional[terse.Engine] = None
        self._open(communicator, process_group, timeout)

    def _open(self, communicator: Optional[terse.Communicator], process_group: Optional[Any],
              timeout: Optional[float]) -> None:
        """Connects to the other workers (terse.elastic's ElasticDiLoCo joins its members
        instead)."""
        comm = communicator if communicator is not None else terse.torch.communicator_for(
            process_group, timeout=timeout)
        self._connect(comm, "terse.diloco.DiLoCo")

    def _connect(self, comm: terse.Communicator, who: str) -> None:
        """Makes the engine over ``comm`` (codec "auto": calibrates) and checks that every
        worker constructed alike. A collective over ``comm``."""
        self.engine = terse.Engine(comm, self.policy.engine_options(threads=self._threads))
        self.policy.calibrate(self.engine)
        if not self.policy.planned:  # one calibration of the engine serves both policies
            self.warmup_policy.calibrate(self.engine)
        terse.torch.check_agreement(self.engine, self._settings(), who, "DiLoCo")

    # ---- construction ------------------------------------------------------------------------

    @staticmethod
    def _split(named: List[Tuple[str, torch.Tensor]],
               fragments: Union[int, Sequence[Sequence[str]]]) -> List[List[Tuple[str,
                                                                                   torch.Tensor]]]:
        if isinstance(fragments, int) and not isinstance(fragments, bool):
            _check(1 <= fragments <= len(named),
                   f"fragments must be between 1 and the {len(named)} trainable parameters, "
                   f"not {fragments}")
            # Contiguous runs in model order, a new one begun where the elements so far pass
            # its share (judged at each parameter's middle), every run non-empty.
            total = sum(p.numel() for _, p in named)
            runs: List[List[Tuple[str, torch.Tensor]]] = [[]]
            done = 0
            for i, (name, p) in enumerate(named):
                left = fragments - len(runs)
                if runs[-1] and left > 0 and (len(named) - i == left or done + p.numel() / 2
                                              > len(runs) * total / fragments):
                    runs.append([])
                runs[-1].append((name, p))
                done += p.numel()
            return runs
        _check(isinstance(fragments, (list, tuple)) and all(
            isinstance(f, (list, tuple)) and f and all(isinstance(n, str) for n in f)
            for f in fragments) and len(fragments) > 0,
            "fragments must be a number or a non-empty list of non-empty lists of parameter "
            f"names, not {fragments!r}")
        by_name = dict(named)
        seen: Dict[str, int] = {}
        runs = []
        for k, names in enumerate(fragments):
            run = []
            for name in names:
                _check(name in by_name, f"fragment {k} names '{name}', which is not a trainable "
                       "parameter of the model")
                _check(name not in seen, f"parameter '{name}' is in fragments {seen.get(name)} "
                       f"and {k}; each must be in one")
                seen[name] = k
                run.append((name, by_name[name]))
            runs.append(run)
        uncovered = [n for n, _ in named if n not in seen]
        _check(not uncovered, f"the fragments do not cover parameter '{uncovered[0]}'"
               if uncovered else "")
        return runs

    def _settings(self) -> Dict[str, Any]:
        """What every worker must share, in the order a mismatch names them."""
        settings: Dict[str, Any] = {
            "sync_every": self.sync_every, "delay": self.delay, "mixing": self.mixing,
            "warmup": self.warmup,
            "codec": self.policy.codec if self.policy.planned
            else terse.canonical_spec(self.policy.codec),
            "warmup_codec": self.warmup_policy.codec if self.warmup_policy.planned
            else terse.canonical_spec(self.warmup_policy.codec),
            "min_bytes": self.policy.min_bytes, "strategy": self.policy.strategy,
            "partitions": self.policy.partitions, "fragments": len(self.fragments)}
        for f in self.fragments:
            settings[f"fragment {f.index}"] = [(n, tuple(p.shape))
                                               for n, p in zip(f.names, f.params)]
            outer = f.outer
            settings[f"outer optimizer (fragment {f.index})"] = (
                type(outer).__name__,
                [{k: v for k, v in g.items() if k != "params"} for g in outer.param_groups])
        return settings

    # ---- the step ----------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The inner optimizer's (a learning-rate scheduler may be given the inner optimizer)."""
        return self.inner.param_groups

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """The inner optimizer's step, then this worker's part of the outer steps due after it:
        merging the exchanges whose delay ran out, starting those of the fragments whose turn it
        is. During the warm-up: the gradients averaged over the workers, then the inner step.
        Every worker must call it alike."""
        if self.steps < self.warmup:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
                closure = None
            self._average_gradients()
            loss = self.inner.step()
            self.steps += 1
            if self.steps == self.warmup:
                with torch.no_grad():
                    for f in self.fragments:
                        for g, p in zip(f.global_params, f.params):
                            g.copy_(p)
            return loss
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self.steps += 1
        for f in self.fragments:
            if f.handle is not None and self.steps >= f.due:
                self._merge(f)
        t = self.steps - self.warmup
        for f, offset in zip(self.fragments, self.offsets):
            if t >= self.sync_every and t % self.sync_every == offset:
                self._start(f)
                if self.delay == 0:
                    self._merge(f)
        return loss

    @torch.no_grad()
    def _average_gradients(self) -> None:
        """The warm-up's synchronous step: every parameter's gradient (zeros where it has none)
        averaged over the workers with the warm-up's codec. A non-finite gradient on any worker
        fails every worker alike before the inner step (as an outer step's does)."""
        items = []
        for f in self.fragments:
            for name, p in zip(f.names, f.params):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                items.append((f"terse.diloco warm-up {name}", p.grad,
                              self.warmup_policy.options_for(p.numel() * 4)))
        nonfinite = self._flag_nonfinite([grad for _, grad, _ in items])
        items.append(("terse.diloco warm-up non-finite", nonfinite,
                      terse.Policy.raw_options(average=False)))
        t0 = time.perf_counter()
        self.engine.allreduce_group(items).wait()
        self._warmed += time.perf_counter() - t0
        bad = _flagged(nonfinite)
        if bad:
            raise terse.InvalidArgument(
                f"terse.diloco: rank {self.engine.rank}: warm-up step {self.steps + 1}: the "
                f"gradient of worker(s) {', '.join(map(str, bad))} is not finite (NaN or Inf); "
                "no inner step was taken")

    def _flag_nonfinite(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        """A non-finite value fails every worker alike, naming the ones it came from: each
        worker sends a 1 in its own slot of this flag (exactly, raw) and zeros in place of its
        non-finite values in ``tensors``, which no codec would encode."""
        flag = torch.zeros(self.engine.size)
        for t in tensors:
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                flag[self.engine.rank] = 1.0
                t.masked_fill_(~finite, 0.0)
        return flag

    @torch.no_grad()
    def _start(self, f: _Fragment) -> None:
        """Submits fragment ``f``'s pseudo-gradient, global - local, averaged over workers."""
        for view, g, p in zip(f.views, f.global_params, f.params):
            torch.sub(g, p, out=view)
        f.nonfinite = self._flag_nonfinite([f.flat])
        items = [(f"terse.diloco {name}", view,
                  self.policy.options_for(view.numel() * 4))
                 for name, view in zip(f.names, f.views)]
        items.append((f"terse.diloco fragment {f.index} non-finite", f.nonfinite,
                      terse.Policy.raw_options(average=False)))
        f.submitted = time.perf_counter()
        # When this exchange completed (the callback may run after wait() returned, when it gets
        # the GIL: the end is the earlier of the two).
        f.completed = completed = []
        f.handle = self.engine.allreduce_group(items)
        f.handle.on_complete(lambda error: completed.append(time.perf_counter()))
        f.started_at = self.steps
        f.due = self.steps + self.delay

    @torch.no_grad()
    def _merge(self, f: _Fragment, mixing: Optional[float] = None) -> None:
        """Waits for fragment ``f``'s exchange, applies the outer step to its global parameters
        and merges them into the local ones."""
        self._wait(f)
        self._apply(f, mixing)

    def _wait(self, f: _Fragment) -> None:
        """Waits for fragment ``f``'s exchange (raises its error: a peer's failure, ...)."""
        handle, f.handle = f.handle, None
        t0 = time.perf_counter()
        handle.wait()
        t1 = time.perf_counter()
        self._waited += t1 - t0
        self._exchanged += min(f.completed[0] if f.completed else t1, t1) - f.submitted

    @torch.no_grad()
    def _apply(self, f: _Fragment, mixing: Optional[float] = None) -> None:
        """Applies fragment ``f``'s outer step (its exchange completed) to the global parameters
        and merges them into the local ones."""
        bad = _flagged(f.nonfinite)
        if bad:
            raise terse.InvalidArgument(
                f"terse.diloco: rank {self.engine.rank}: outer step of fragment {f.index} at "
                f"inner step {f.started_at}: the pseudo-gradient of worker(s) "
                f"{', '.join(map(str, bad))} is not finite (NaN or Inf); the global parameters "
                "are unchanged")
        for g, view in zip(f.global_params, f.views):
            g.grad = view.clone()
        f.outer.step()
        for g in f.global_params:
            g.grad = None
        mixing = self.mixing if mixing is None else mixing
        for p, g in zip(f.params, f.global_params):
            if mixing == 0.0:
                p.copy_(g)
            else:
                p.mul_(mixing).add_(g, alpha=1.0 - mixing)
        self.outer_steps += 1

    def finish(self) -> None:
        """Ends training on every worker alike: merges the exchanges in flight, then takes one
        more outer step for each fragment that trained since its last one, merged without
        mixing. Afterwards every worker's model holds the global parameters, which include
        every inner step."""
        for f in self.fragments:
            if f.handle is not None:
                self._merge(f)
        behind = [f for f in self.fragments if f.started_at < self.steps]
        for f in behind:
            self._start(f)
        for f in behind:
            self._merge(f, mixing=0.0)

    # ---- what it did -------------------------------------------------------------------------

    def global_parameters(self) -> Dict[str, torch.Tensor]:
        """The global parameters by name (bit-identical on every worker; an exchange in flight
        is not in them yet)."""
        return {n: g.detach() for f in self.fragments for n, g in zip(f.names, f.global_params)}

    def global_model(self) -> torch.nn.Module:
        """A copy of the model (the module DDP wraps) holding the global parameters: what to
        evaluate."""
        module = copy.deepcopy(getattr(self.model, "module", self.model))
        params = dict(module.named_parameters())
        with torch.no_grad():
            for n, g in self.global_parameters().items():
                params[n].copy_(g)
        return module

    def stats(self) -> Dict[str, Any]:
        """``outer_steps`` (fragment exchanges merged), ``bytes_sent`` by this worker,
        ``exchange_seconds`` (from submission to completion, summed), ``waited_seconds`` (what
        :meth:`step` spent waiting for them) and ``hidden`` (the share of exchange time spent
        during inner steps rather than waiting; None before the first exchange)."""
        return {"outer_steps": self.outer_steps, "bytes_sent": self.engine.bytes_sent,
                "exchange_seconds": self._exchanged, "waited_seconds": self._waited,
                "warmup_seconds": self._warmed,
                "hidden": (max(0.0, 1.0 - self._waited / self._exchanged)
                           if self._exchanged > 0 else None)}

    @property
    def bytes_sent(self) -> int:
        return self.engine.bytes_sent

    # ---- checkpoints -------------------------------------------------------------------------

    def _fixed_settings(self) -> Dict[str, Any]:
        return {"sync_every": self.sync_every, "delay": self.delay, "mixing": self.mixing,
                "warmup": self.warmup, "fragments": [list(f.names) for f in self.fragments]}

    def state_dict(self) -> Dict[str, Any]:
        """This worker's DiLoCo state: the global parameters, each fragment's outer optimizer,
        the exchanges in flight (completed and kept as received), the inner optimizer's state,
        the step counters and the engine's error-feedback residuals. The model's own (local)
        parameters are the user's to save, as with any optimizer."""
        pending = []
        for f in self.fragments:
            if f.handle is not None:
                f.handle.wait()
                pending.append({"fragment": f.index, "started_at": f.started_at, "due": f.due,
                                "received": f.flat.clone(), "nonfinite": f.nonfinite.clone()})
        self.engine.synchronize()
        return {**self.policy.state_dict(rank=self.engine.rank, size=self.engine.size),
                **self._fixed_settings(),
                "diloco_version": STATE_VERSION,
                "steps": self.steps, "outer_steps": self.outer_steps,
                "global": [[g.detach().clone() for g in f.global_params]
                           for f in self.fragments],
                "outer": [f.outer.state_dict() for f in self.fragments],
                "pending": pending,
                "inner": self.inner.state_dict(),
                "engine": self.engine.save_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output saved by the same worker of a job of the same size
        and settings: training continues bit for bit (with the model's parameters restored by
        the user). Raises DecodeError for another version and MismatchError naming the first
        setting that differs; then nothing changes."""
        what = "terse.diloco.DiLoCo state"
        self.policy.load_state_dict(state, rank=self.engine.rank, size=self.engine.size,
                                    what=what, settings=self._fixed_settings(),
                                    absent={"warmup": 0})
        if state.get("diloco_version") != STATE_VERSION:
            raise terse.DecodeError(f"{what}: diloco_version {state.get('diloco_version')!r}, "
                                    f"expected {STATE_VERSION}")
        for f, saved in zip(self.fragments, state["global"]):
            if [tuple(t.shape) for t in saved] != [tuple(g.shape) for g in f.global_params]:
                raise terse.DecodeError(f"{what}: fragment {f.index}'s global parameters have "
                                        "other shapes")
        for f in self.fragments:  # exchanges in flight are replaced by the checkpoint's
            if f.handle is not None:
                f.handle.wait()
                f.handle = None
        self.engine.synchronize()
        self.engine.load_state(state["engine"])
        with torch.no_grad():
            for f, saved, outer in zip(self.fragments, state["global"], state["outer"]):
                for g, t in zip(f.global_params, saved):
                    g.copy_(t)
                f.outer.load_state_dict(outer)
        self.inner.load_state_dict(state["inner"])
        self.steps = int(state["steps"])
        self.outer_steps = int(state["outer_steps"])
        for p in state["pending"]:
            f = self.fragments[p["fragment"]]
            f.flat.copy_(p["received"])
            f.nonfinite = p["nonfinite"].clone()
            f.started_at, f.due = int(p["started_at"]), int(p["due"])
            f.handle = _Done()
            f.submitted, f.completed = time.perf_counter(), []

    def close(self) -> None:
        """Waits for outstanding exchanges and releases the engine's threads and connections."""
        self.engine.close()


def _flagged(flag: torch.Tensor) -> List[int]:
    """The workers whose slot of a summed non-finite flag is set."""
    return [r for r, v in enumerate(flag.tolist()) if v != 0.0]


class _Done:
    """A completed exchange restored from a checkpoint."""

    def wait(self) -> None:
        pass
