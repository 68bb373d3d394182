"""Optimizers that communicate: 1-bit Adam and 0/1 Adam over terse's compressed collectives.

Both are ``torch.optim.Optimizer`` subclasses that exchange their momentum themselves, 1-bit
compressed with error feedback on both sides of the exchange (the worker's and the shard
owner's residual), through one :class:`terse.Engine` each::

    optimizer = terse.optim.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=1000)
    # with DDP: let the optimizer decide when DDP's gradients are averaged
    model.register_comm_hook(*optimizer.ddp_hook())

:class:`OneBitAdam` (Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
with Adam's Convergence Speed", ICML 2021) runs exact Adam on averaged gradients for
``freeze_step`` steps, then freezes the variance and exchanges only the momentum, compressed.
:class:`ZeroOneAdam` (Lu et al., "Maximizing Communication Efficiency for Large-scale Training
via 0/1 Adam", ICLR 2023) updates the variance at exponentially spaced steps until
``var_freeze_step`` and then synchronizes at exponentially spaced local steps. Both follow
DeepSpeed's ``OnebitAdam`` and ``ZeroOneAdam`` step for step; docs/python.md lists where they
differ and why.

With DDP, the hook of :meth:`ddp_hook` averages gradients exactly (terse's raw allreduce) on the
steps whose update needs averaged gradients and returns local gradients, sending nothing, on
the others. Without DDP, :meth:`step` averages the gradients itself on those steps.

Each parameter group's state lives in one flat fp32 buffer per quantity (the parameters' moments
are views into it), and the compressed exchange submits every group's buffer at once: the engine
cuts each into partitions and pipelines them. Results are bit-identical on every rank.
"""

import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

import terse
import terse.torch
from terse.policy import Door

__all__ = ["OneBitAdam", "ZeroOneAdam", "OPTIMIZER"]

# The door of the optimizers: they exchange with one named codec (error feedback on both sides
# of the sharded exchange is what the algorithms assume), so no planner chooses for them.
OPTIMIZER = Door(
    "terse.optim", tiers=(),
    refused_tiers_reason="the optimizer's exchange is the compressed allreduce of its algorithm, "
                         "which a planner does not choose: name a codec with error feedback, "
                         "e.g. 'onebit:ef=1'")
# The version of the checkpoints state_dict() writes.
STATE_VERSION = 1
_RAW = terse.Policy.raw_options()


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise terse.InvalidArgument(f"terse.optim: {what}")


def _check_hyper(group: Dict[str, Any], where: str) -> None:
    lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    _check(isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0,
           f"lr must be a finite number >= 0, not {lr!r}{where}")
    _check(isinstance(betas, (tuple, list)) and len(betas) == 2
           and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas),
           f"betas must be two numbers in [0, 1), not {betas!r}{where}")
    _check(isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0,
           f"eps must be a finite number > 0, not {eps!r}{where}")
    _check(isinstance(wd, (int, float)) and math.isfinite(wd) and wd >= 0,
           f"weight_decay must be a finite number >= 0, not {wd!r}{where}")


def _check_count(name: str, value: Any, least: int) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= least,
           f"{name} must be an integer >= {least}, not {value!r}")


class _Group:
    """One parameter group's flat state: each parameter's moments are views into it."""

    def __init__(self, params: List[torch.Tensor], quantities: Iterable[str]) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.flat: Dict[str, torch.Tensor] = {q: torch.zeros(self.numel) for q in quantities}

    def views(self, quantity: str) -> List[torch.Tensor]:
        return [v.view_as(p) for v, p in
                zip(torch.split(self.flat[quantity], self.sizes), self.params)]

    def gather_grads(self) -> torch.Tensor:
        """This rank's gradients in the flat buffer "grad" (a missing gradient counts as 0)."""
        for p, v in zip(self.params, self.views("grad")):
            if p.grad is None:
                v.zero_()
            else:
                v.copy_(p.grad)
        return self.flat["grad"]

    def gather_params(self, into: str) -> None:
        for p, v in zip(self.params, self.views(into)):
            v.copy_(p.detach())

    def apply(self, update: torch.Tensor, lr: float, weight_decay: float,
              accumulate: Optional[torch.Tensor] = None) -> None:
        """p -= lr * (update + weight_decay * p), as DeepSpeed writes it; ``accumulate`` (flat)
        receives -lr * (that update) as well."""
        if weight_decay > 0.0:
            params = torch.cat([p.detach().reshape(-1) for p in self.params])
            update = update + weight_decay * params
        step = -lr * update
        if accumulate is not None:
            accumulate.add_(step)
        with torch.no_grad():
            for p, s in zip(self.params, torch.split(step, self.sizes)):
                p.add_(s.view_as(p))

    def set_params(self, source: str) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, self.views(source)):
                p.copy_(v)


class _HookState:
    """The state of :meth:`_CommunicatingAdam.ddp_hook`'s DDP hook: the optimizer it asks."""

    def __init__(self, optimizer: "_CommunicatingAdam") -> None:
        self.optimizer = optimizer

    def submit(self, bucket: dist.GradBucket) -> "torch.futures.Future[torch.Tensor]":
        return self.optimizer._hook_submit(bucket)


# DDP checks these annotations literally: no postponed annotations in this module.
def _hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.submit(bucket)


class _CommunicatingAdam(torch.optim.Optimizer):
    """What 1-bit Adam and 0/1 Adam share: validation, the engine, the flat state, the DDP hook,
    the agreement check and checkpoints. Subclasses define ``_quantities``, ``_settings``,
    ``_wants_average`` and ``_step``."""

    _quantities: Tuple[str, ...] = ()

    def __init__(self, params: Any, defaults: Dict[str, Any], *, codec: str, strategy: str,
                 precondition: bool, threads: int, model: Optional[torch.nn.Module],
                 communicator: Optional[terse.Communicator], process_group: Optional[Any],
                 timeout: Optional[float]) -> None:
        _check_hyper(defaults, "")
        _check_count("threads", threads, 0)
        _check(isinstance(precondition, bool), f"precondition must be True or False, not "
                                               f"{precondition!r}")
        self.precondition = precondition
        try:
            self.policy = terse.Policy(codec, min_bytes=0, strategy=strategy, door=OPTIMIZER)
        except terse.SpecError as e:
            raise terse.InvalidArgument(f"terse.optim: codec {codec!r}: {e}") from e
        self._constructing = True
        super().__init__(params, defaults)
        self._constructing = False
        names: Dict[int, str] = {}
        if model is not None:
            module = getattr(model, "module", model)
            names = {id(p): n for n, p in module.named_parameters()}
        self._names: Dict[int, str] = {}
        self._groups: List[_Group] = []
        for i, group in enumerate(self.param_groups):
            _check_hyper(group, f" (parameter group {i})")
            params_i = [p for p in group["params"] if p.requires_grad]
            for j, p in enumerate(params_i):
                name = names.get(id(p), f"group{i}.param{j}")
                if hasattr(p, "_local_tensor") or getattr(p, "_is_flat_param", False):
                    raise terse.InvalidArgument(
                        f"terse.optim: parameter '{name}' is a shard of an FSDP model; the "
                        "optimizer averages whole replicas of every parameter, which FSDP's "
                        "ranks do not hold (compress FSDP's reduce-scatter with terse.fsdp and "
                        "use a local optimizer instead)")
                terse.torch.check_parameter(name, p)
                if p.dtype != torch.float32:
                    raise TypeError(f"terse.optim: parameter '{name}' is {p.dtype}; the "
                                    "optimizer keeps fp32 parameters (model.float())")
                self._names[id(p)] = f"group{i}.param{j}"
            self._groups.append(_Group(params_i, self._quantities))
        self.steps = 0
        self._hook_averaged: Optional[int] = None  # the step whose gradients the hook averaged
        self._hook_created = False
        comm = communicator if communicator is not None else terse.torch.communicator_for(
            process_group, timeout=timeout)
        self.engine = terse.Engine(comm, self.policy.engine_options(threads=threads))
        self._check_agreement()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if not getattr(self, "_constructing", True):
            raise terse.InvalidArgument(
                "terse.optim: parameter groups are fixed at construction (their state is one "
                "flat buffer exchanged by every rank alike)")
        super().add_param_group(param_group)

    # ---- what every rank must agree on -------------------------------------------------------

    def _settings(self) -> Dict[str, Any]:
        """The settings every rank must share, in the order a mismatch names them."""
        settings: Dict[str, Any] = {"optimizer": type(self).__name__,
                                    "codec": terse.canonical_spec(self.policy.codec),
                                    "strategy": self.policy.strategy,
                                    "precondition": self.precondition,
                                    "parameter groups": len(self._groups)}
        for i, (group, flat) in enumerate(zip(self.param_groups, self._groups)):
            for key in ("lr", "betas", "eps", "weight_decay"):
                settings[f"{key} (group {i})"] = tuple(group[key]) if key == "betas" else group[key]
            settings[f"parameter shapes (group {i})"] = [tuple(p.shape) for p in flat.params]
        return settings

    def _check_agreement(self) -> None:
        terse.torch.check_agreement(self.engine, self._settings(),
                                    f"terse.optim.{type(self).__name__}", "optimizer")

    # ---- communication -----------------------------------------------------------------------

    def _options(self) -> terse.AllreduceOptions:
        return self.policy.compressed_options()

    def _denominators(self) -> List[torch.Tensor]:
        """Per group, sqrt(v) + eps: what the update divides the momentum by."""
        return [g.flat["exp_avg_sq"].sqrt().add_(group["eps"])
                for group, g in zip(self.param_groups, self._groups)]

    def _compressed_allreduce(self, quantity: str, name: str, scaled: bool = False) -> None:
        """Averages every group's flat ``quantity`` across ranks, compressed with error feedback
        on both sides (tensor ``name`` keys the residuals): one submission for all groups.

        With ``precondition``, a ``quantity`` in the momentum's units (not ``scaled``) is divided
        by sqrt(v) + eps before it is compressed and multiplied back after, so that what is
        compressed (and what error feedback carries) is in the update's units: each element's
        compression error then moves its parameter by an amount of the size of the others' in
        its chunk, instead of that error divided by its own sqrt(v). A ``scaled`` quantity is in
        the update's units already and is exchanged as it is."""
        if self.engine.size == 1:
            return
        divide = self.precondition and not scaled
        denominators = self._denominators() if divide else []
        seen = [g.flat["exp_avg_sq"] > 0 for g in self._groups]
        for i, g in enumerate(self._groups):
            if divide:
                g.flat[quantity].div_(denominators[i])
            if self.precondition:
                # Elements whose variance is 0 would be m / eps: they would set their chunk's
                # scale. They are 0 after the exchange anyway (below).
                g.flat[quantity].mul_(seen[i])
        options = self._options()
        items = [(f"terse.optim group{i} {name}", g.flat[quantity], options)
                 for i, g in enumerate(self._groups) if g.numel > 0]
        if items:
            self.engine.allreduce_group(items).wait()
        # 1 bit cannot say 0: elements whose variance is exactly 0 (no gradient ever reached
        # them, e.g. inputs that are always 0) would move by m / eps. They keep m = 0 (the mask
        # DeepSpeed asks its users to give as exp_avg_mask).
        for i, g in enumerate(self._groups):
            g.flat[quantity].mul_(seen[i])
            if divide:
                g.flat[quantity].mul_(denominators[i])

    def _average_grads(self) -> None:
        """Averages every group's flat gradient exactly (terse's raw allreduce)."""
        if self.engine.size == 1:
            return
        items = [(f"terse.optim group{i} grad", g.flat["grad"], _RAW)
                 for i, g in enumerate(self._groups) if g.numel > 0]
        if items:
            self.engine.allreduce_group(items).wait()

    def _averaged_grads(self) -> None:
        """The flat gradients, averaged over ranks: by the DDP hook for this step, or here."""
        for g in self._groups:
            g.gather_grads()
        if self._hook_averaged != self.steps + 1:
            self._average_grads()

    def _local_grads(self) -> None:
        for g in self._groups:
            g.gather_grads()

    # ---- DDP ---------------------------------------------------------------------------------

    def ddp_hook(self) -> Tuple[_HookState, Callable[..., Any]]:
        """``(state, hook)`` for ``model.register_comm_hook(state, hook)`` on the DDP model of
        these parameters: the hook averages a bucket's gradients exactly when the coming step
        needs averaged gradients (1-bit Adam's warm-up, 0/1 Adam's variance updates), and
        otherwise hands DDP the local gradients back, sending nothing (the optimizer exchanges
        its momentum in :meth:`step`)."""
        self._hook_created = True
        return _HookState(self), _hook

    def _hook_submit(self, bucket: dist.GradBucket) -> "torch.futures.Future[torch.Tensor]":
        buffer = bucket.buffer()
        if not self._wants_average(self.steps + 1) or self.engine.size == 1:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(buffer)
            return done
        items = []
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            name = self._names.get(id(param))
            if name is None:
                raise terse.InvalidArgument(
                    f"terse.optim: DDP bucket {bucket.index()} holds a parameter of shape "
                    f"{list(param.shape)} that this optimizer does not update; register the "
                    "hook on the DDP model of the optimizer's parameters")
            items.append((f"terse.optim {name}", grad, _RAW))
        items.sort(key=lambda item: item[0])
        handle = self.engine.allreduce_group(items)
        self._hook_averaged = self.steps + 1
        result: torch.futures.Future[Any] = torch.futures.Future()
        handle.on_complete(lambda error: result.set_result(buffer if error is None else error))
        return result.then(terse.torch._unwrap)

    # ---- the step ----------------------------------------------------------------------------

    def _wants_average(self, step: int) -> bool:
        raise NotImplementedError

    def _step(self, step: int) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One update; communicates on every rank alike (call it on every rank)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(self.steps + 1)
        self.steps += 1
        return loss

    # ---- checkpoints -------------------------------------------------------------------------

    def _counters(self) -> Dict[str, Any]:
        return {}

    def _load_counters(self, counters: Dict[str, Any]) -> None:
        pass

    def _fixed_settings(self) -> Dict[str, Any]:
        """Settings a checkpoint must have been saved with (the hyper-parameters of the groups
        are restored from it instead, as torch's optimizers do)."""
        return {"optimizer": type(self).__name__, "precondition": self.precondition,
                "group sizes": [g.numel for g in self._groups]}

    def state_dict(self) -> Dict[str, Any]:
        """This rank's optimizer state: the groups' hyper-parameters, the flat moments (and what
        else the algorithm keeps), the step counters and the engine's error-feedback residuals
        of both sides of the exchange. Every rank saves its own (residuals differ per rank)."""
        self.engine.synchronize()
        groups = [{k: v for k, v in group.items() if k != "params"}
                  for group in self.param_groups]
        return {**self.policy.state_dict(rank=self.engine.rank, size=self.engine.size),
                **self._fixed_settings(),
                "optimizer_version": STATE_VERSION,
                "param_groups": groups,
                "steps": self.steps,
                "counters": self._counters(),
                "state": [{q: t.clone() for q, t in g.flat.items() if q != "grad"}
                          for g in self._groups],
                "engine": self.engine.save_state()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output saved by the same rank of a job of the same size
        and configuration: training continues bit for bit. Raises DecodeError for another
        version, MismatchError naming the first setting that differs; then nothing changes."""
        what = f"terse.optim.{type(self).__name__} state"
        self.policy.load_state_dict(state_dict, rank=self.engine.rank, size=self.engine.size,
                                    what=what, settings=self._fixed_settings())
        if state_dict.get("optimizer_version") != STATE_VERSION:
            raise terse.DecodeError(f"{what}: optimizer_version "
                                    f"{state_dict.get('optimizer_version')!r}, expected "
                                    f"{STATE_VERSION}")
        saved = state_dict["state"]
        for i, (g, s) in enumerate(zip(self._groups, saved)):
            for q in g.flat:
                if q != "grad" and (q not in s or s[q].numel() != g.numel):
                    raise terse.DecodeError(f"{what}: group {i} has no {q} of {g.numel} elements")
        self.engine.synchronize()
        self.engine.load_state(state_dict["engine"])
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        for g, s in zip(self._groups, saved):
            for q, t in g.flat.items():
                if q != "grad":
                    t.copy_(s[q])
        self.steps = int(state_dict["steps"])
        self._hook_averaged = None
        self._load_counters(state_dict["counters"])

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank's engine has sent (the optimizer's exchanges and the hook's)."""
        return self.engine.bytes_sent

    def close(self) -> None:
        """Waits for outstanding exchanges and releases the engine's threads and connections."""
        self.engine.close()


class OneBitAdam(_CommunicatingAdam):
    """1-bit Adam (Tang et al., ICML 2021), as DeepSpeed's ``OnebitAdam`` runs it.

    Steps 1 to ``freeze_step``: Adam on averaged gradients (exact: the DDP hook of
    :meth:`ddp_hook` or, without DDP, :meth:`step` averages them),
    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``. From step ``freeze_step + 1``, ``v``
    is frozen and each rank folds its local gradient into ``m``, which is then averaged across
    ranks with ``codec`` over the ``sharded`` strategy: every rank compresses each shard with its
    worker residual, each shard's owner averages the contributions and compresses the average
    with its server residual, and every rank decodes the owners' results (bit-identical
    everywhere). Every step: ``p -= lr (m / (sqrt(v) + eps) + weight_decay p)`` (no bias
    correction, as in DeepSpeed).

    params, lr, betas, eps, weight_decay
        As ``torch.optim.Adam``'s (weight decay is added to the update, scaled by lr).
    freeze_step
        Warm-up steps of exact Adam before the variance freezes. DeepSpeed's default is 100000;
        it should cover the learning-rate warm-up (the papers use 15-25 % of training).
    codec
        The compressed exchange's codec (``terse.canonical_spec`` shows every parameter):
        ``"onebit:ef=1"`` sends 1 bit per element and one fp32 scale (mean |x|) per 1024;
        ``"onebit:chunk=0,ef=1"`` one scale per shard, as DeepSpeed. Any codec with ``ef=1``
        works, e.g. ``"minmax8:ef=1"``.
    strategy
        ``"sharded"``: the two-phase exchange with both residuals. ``"allgather"``: every rank
        decodes every rank's payload (worker residuals only; more bytes).
    precondition
        True (terse's default): compress ``m / (sqrt(v) + eps)``, the update, and multiply the
        average back, so that compression errors move every parameter alike instead of by the
        error over its own sqrt(v). False: compress ``m`` itself, as DeepSpeed does.
    model
        The model (or DDP model): names parameters in error messages.
    communicator, process_group, timeout, threads
        How the optimizer's engine connects (:func:`terse.torch.communicator_for`: the default
        process group's store, else the environment), bounds every wait, and how many threads
        encode and decode (0: ``TERSE_THREADS``, else 4).

    Every rank must construct it alike: the constructor checks the settings across ranks and
    raises :class:`terse.MismatchError` naming the first that differs. Attributes: ``steps``,
    ``frozen`` (the variance is frozen: the momentum travels compressed), ``engine``, ``policy``,
    ``bytes_sent``.
    """

    _quantities = ("exp_avg", "exp_avg_sq", "grad")

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100000, *,
                 codec: str = "onebit:ef=1", strategy: str = "sharded",
                 precondition: bool = True, threads: int = 0,
                 model: Optional[torch.nn.Module] = None,
                 communicator: Optional[terse.Communicator] = None,
                 process_group: Optional[Any] = None, timeout: Optional[float] = None) -> None:
        _check_count("freeze_step", freeze_step, 0)
        self.freeze_step = freeze_step
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay),
                         codec=codec, strategy=strategy, precondition=precondition,
                         threads=threads, model=model,
                         communicator=communicator, process_group=process_group,
                         timeout=timeout)

    @property
    def frozen(self) -> bool:
        return self.steps >= self.freeze_step

    def _settings(self) -> Dict[str, Any]:
        return {**super()._settings(), "freeze_step": self.freeze_step}

    def _fixed_settings(self) -> Dict[str, Any]:
        return {**super()._fixed_settings(), "freeze_step": self.freeze_step}

    def _wants_average(self, step: int) -> bool:
        return step <= self.freeze_step

    def _step(self, step: int) -> None:
        warm = self._wants_average(step)
        if warm:
            self._averaged_grads()
        else:
            self._local_grads()
        for group, g in zip(self.param_groups, self._groups):
            beta1, beta2 = group["betas"]
            m, v, grad = g.flat["exp_avg"], g.flat["exp_avg_sq"], g.flat["grad"]
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            if warm:
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if not warm:
            self._compressed_allreduce("exp_avg", "momentum")
        for group, g in zip(self.param_groups, self._groups):
            update = g.flat["exp_avg"] / (g.flat["exp_avg_sq"].sqrt() + group["eps"])
            g.apply(update, group["lr"], group["weight_decay"])


class ZeroOneAdam(_CommunicatingAdam):
    """0/1 Adam (Lu et al., ICLR 2023), as DeepSpeed's ``ZeroOneAdam`` runs it.

    Until ``var_freeze_step``, the variance is updated only at steps ``s`` with
    ``s % var_interval == 0`` (on gradients averaged exactly: the DDP hook or :meth:`step` does
    it); ``var_interval`` starts at 1 and doubles after every ``var_update_scaler`` such
    updates. At the other steps the local gradients are averaged compressed (``codec`` over
    ``strategy``, error feedback on both sides) and folded into the momentum. After step
    ``var_freeze_step + 1`` the variance is frozen and each rank takes local steps with its own
    momentum; at steps ``s % local_step_interval == 0`` the ranks average their accumulated
    updates (rescaled by ``sqrt(v) + eps``, compressed with fresh residuals), restore the
    parameters of the last synchronization plus that average, and set the momentum to the
    learning-rate-weighted mean it implies. ``local_step_interval`` starts at 1 and doubles
    every ``local_step_scaler`` steps, up to ``local_step_clipper``. Every step:
    ``p -= lr (m / (sqrt(v) + eps) + weight_decay p)`` (no bias correction, as in DeepSpeed).

    var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper
        As DeepSpeed's (defaults 100000, 16, 32678, 16): the last step of variance updates
        (usually the end of the learning-rate warm-up), the kappa of the variance schedule,
        the steps between doublings of the local-step interval, and its largest value (H).
    The other knobs are :class:`OneBitAdam`'s.

    Parameters are bit-identical on every rank after each step that synchronizes
    (``synchronized``: every step before the variance freezes, and each
    ``local_step_interval``-th after); between them each rank's differ, by design.
    """

    _quantities = ("exp_avg", "exp_avg_sq", "grad", "accumulator", "anchor")

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678,
                 local_step_clipper: int = 16, *, codec: str = "onebit:ef=1",
                 strategy: str = "sharded", precondition: bool = True, threads: int = 0,
                 model: Optional[torch.nn.Module] = None,
                 communicator: Optional[terse.Communicator] = None,
                 process_group: Optional[Any] = None, timeout: Optional[float] = None) -> None:
        _check_count("var_freeze_step", var_freeze_step, 0)
        _check_count("var_update_scaler", var_update_scaler, 1)
        _check_count("local_step_scaler", local_step_scaler, 1)
        _check_count("local_step_clipper", local_step_clipper, 1)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.frozen = False
        self.synchronized = True
        self.var_interval = 1
        self.var_counter = 0
        self.local_step_interval = 1
        self.local_step_counter = 0
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay),
                         codec=codec, strategy=strategy, precondition=precondition,
                         threads=threads, model=model,
                         communicator=communicator, process_group=process_group,
                         timeout=timeout)
        # The learning rates summed since the last synchronization, per group (DeepSpeed's lrs).
        self._lrs = [0.0] * len(self._groups)

    _KNOBS = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")

    def _settings(self) -> Dict[str, Any]:
        return {**super()._settings(), **{k: getattr(self, k) for k in self._KNOBS}}

    def _fixed_settings(self) -> Dict[str, Any]:
        return {**super()._fixed_settings(), **{k: getattr(self, k) for k in self._KNOBS}}

    _COUNTERS = ("frozen", "synchronized", "var_interval", "var_counter",
                 "local_step_interval", "local_step_counter")

    def _counters(self) -> Dict[str, Any]:
        return {**{k: getattr(self, k) for k in self._COUNTERS}, "lrs": list(self._lrs)}

    def _load_counters(self, counters: Dict[str, Any]) -> None:
        for k in self._COUNTERS:
            setattr(self, k, type(getattr(self, k))(counters[k]))
        self._lrs = [float(x) for x in counters["lrs"]]

    def _wants_average(self, step: int) -> bool:
        return not self.frozen and step % self.var_interval == 0

    def _step(self, step: int) -> None:
        if not self.frozen:
            self._variance_step(step)
        else:
            self._local_step(step)
        if not self.frozen and step > self.var_freeze_step:
            self.frozen = True
            for g in self._groups:
                g.gather_params("anchor")

    def _variance_step(self, step: int) -> None:
        exact = step % self.var_interval == 0
        if exact:
            self._averaged_grads()
        else:
            self._local_grads()
            self._compressed_allreduce("grad", "gradient")
        for group, g in zip(self.param_groups, self._groups):
            beta1, beta2 = group["betas"]
            m, v, grad = g.flat["exp_avg"], g.flat["exp_avg_sq"], g.flat["grad"]
            if exact:
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            update = m / (v.sqrt() + group["eps"])
            g.apply(update, group["lr"], group["weight_decay"])
        if exact:
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:
                self.var_counter = 0
                self.var_interval *= 2
        self.synchronized = True

    def _local_step(self, step: int) -> None:
        self._local_grads()
        sync = step % self.local_step_interval == 0
        for i, (group, g) in enumerate(zip(self.param_groups, self._groups)):
            beta1 = group["betas"][0]
            m, v, grad = g.flat["exp_avg"], g.flat["exp_avg_sq"], g.flat["grad"]
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            self._lrs[i] += group["lr"]
            update = m / (v.sqrt() + group["eps"])
            g.apply(update, group["lr"], group["weight_decay"], accumulate=g.flat["accumulator"])
            if sync and not self.precondition:
                g.flat["accumulator"].mul_(v.sqrt() + group["eps"])
        if sync:
            # The accumulated updates, in the update's units; without preconditioning they are
            # exchanged in the momentum's, as DeepSpeed does.
            self._compressed_allreduce("accumulator", "momentum", scaled=True)
            for i, (group, g) in enumerate(zip(self.param_groups, self._groups)):
                acc, v = g.flat["accumulator"], g.flat["exp_avg_sq"]
                denominator = v.sqrt() + group["eps"]
                if self.precondition:
                    acc.mul_(denominator)
                if self._lrs[i] > 0:
                    g.flat["exp_avg"].copy_(acc).div_(-self._lrs[i])
                else:
                    g.flat["exp_avg"].zero_()
                # The parameters of the last synchronization plus the averaged update, the same
                # bits on every rank (DeepSpeed subtracts the local updates from p instead).
                g.flat["anchor"].add_(acc / denominator)
                g.set_params("anchor")
                acc.zero_()
                self._lrs[i] = 0.0
        self.synchronized = sync
        self.local_step_counter += 1
        if self.local_step_counter == self.local_step_scaler:
            self.local_step_counter = 0
            self.local_step_interval = min(self.local_step_clipper, self.local_step_interval * 2)
