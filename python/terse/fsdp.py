"""Compressed collectives for PyTorch's fully sharded data parallelism (FSDP).

FSDP2 (``torch.distributed.fsdp.fully_shard``; torch 2.15 has it, with
``FSDPModule.set_custom_reduce_scatter`` and ``set_custom_all_gather``)::

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = terse.fsdp.compress(model, codec="minmax8:ef=1", all_gather_codec="minmax8")

installs on every FSDP module of ``model`` a gradient reduce-scatter that runs through terse's
engine with ``codec`` (per parameter: parameters of at least ``min_bytes`` compressed, the others
raw), and, with ``all_gather_codec``, a parameter all-gather that sends each rank's shard encoded
with that codec. FSDP keeps its sharded parameters (the optimizer's) in full precision; only the
gathered full parameters used for forward and backward are the decoded ones, and they are
bit-identical on every rank (every rank decodes the same encodings, its own shard's included),
so replicas never drift apart.

FSDP1 (``FullyShardedDataParallel``, on CPU with ``device_id=torch.device("cpu")``)::

    state = terse.fsdp.fsdp1_hook(model, codec="minmax8:ef=1")

registers the sharded communication hook ``hook(state, grad, output)`` on every FSDP unit.

Error-feedback residuals and codec state are kept per parameter (FSDP2) or per flat parameter
(FSDP1), under names from the module tree, and are checkpointed with ``state.state_dict()`` /
``state.load_state_dict()`` (each rank saves its own).

Hosts of several ranks (docs/topology.md): the engine's reduce-scatter and all-gather run in two
levels where the job spans hosts of several ranks (``hierarchy="auto"``): gradients are summed
exactly inside each host and cross the network once per host, compressed; each parameter shard
crosses once to every other host and is handed on inside it. With FSDP2's
``fully_shard(module, reshard_after_forward=R)``, R the ranks per host (ZeRO++'s hpZ: a
secondary shard of the gathered parameters inside each host), the backward pass gathers the
parameters from that secondary shard inside the host, through the process group, so only the
forward all-gather crosses hosts.
"""

import os
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import terse
from terse.policy import FSDP
from terse.torch import communicator_for

__all__ = ["TerseFSDPState", "compress", "fsdp1_hook", "ReduceScatter", "AllGather",
           "ranks_per_host"]

# What the engine reduces; FSDP's other buffers (uint8 all-gathers of mixed-dtype groups) travel
# through the process group unchanged.
_ENGINE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---- the engine collectives ------------------------------------------------------------------
# Every use of reduce-scatter and all-gather goes through these two functions, so that the
# engine's own collectives replace them in one place.


def _reduce_scatter(engine: terse.Engine,
                    items: Sequence[Tuple[str, torch.Tensor, torch.Tensor,
                                          terse.AllreduceOptions]]) -> None:
    """Reduce-scatters each (name, input, output, options): ``input`` holds ``size`` shards of
    ``output``'s length, shard r belongs to rank r; ``output`` gets this rank's shard of the sum
    (the average with ``options.average``), through the engine's reduce-scatter with
    ``options.codec`` (raw: the exact sum in rank order, or in two levels of host sums; a codec:
    its default strategy, every contribution, or every host's exact sum, quantized once and
    summed in fp32) and ``options.hierarchy``. All are submitted, then waited for."""
    handles = [engine.reduce_scatter(name, inp, out, codec=options.codec,
                                     average=options.average, hierarchy=options.hierarchy)
               for name, inp, out, options in items]
    for handle in handles:
        handle.wait()


def _all_gather(engine: terse.Engine, name: str, inp: torch.Tensor, out: torch.Tensor,
                codec: str, hierarchy: str) -> None:
    """Gathers every rank's ``inp`` into ``out`` (rank r's at ``out[r * n:(r + 1) * n]``), each
    shard encoded once with ``codec`` and decoded by every rank, so ``out`` is bit-identical on
    all ranks (in two levels too: the payloads are handed on as they are). Blocks until done.
    ``inp`` may be a view of ``out``."""
    engine.all_gather(name, inp, out, codec=codec, hierarchy=hierarchy).wait()


def _check_group(state: "TerseFSDPState", group: dist.ProcessGroup, what: str) -> None:
    if group.size() != state.engine.size:
        raise terse.InvalidArgument(
            f"terse.fsdp: FSDP asked for a {what} among {group.size()} ranks; terse's engine "
            f"spans the job's {state.engine.size} (HSDP's sharding groups are not supported)")


# ---- FSDP2 ---------------------------------------------------------------------------------


def _is_average(op: Any) -> bool:
    if op == dist.ReduceOp.AVG:
        return True
    if op == dist.ReduceOp.SUM:
        return False
    raise terse.InvalidArgument(
        f"terse.fsdp: FSDP asked for a reduce-scatter with {op}; terse reduces with SUM or AVG "
        "(FSDP uses PREMUL_SUM only with set_gradient_divide_factor: leave it unset)")


class ReduceScatter:
    """FSDP2's custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) for one FSDP
    module: FSDP calls it with the module's gradients laid out as ``size`` rows, row r holding
    rank r's shard of each parameter in turn. Each parameter's gradient is reduce-scattered by
    terse under the parameter's name (its error feedback and codec state keyed by that name)."""

    def __init__(self, state: "TerseFSDPState", module_name: str, module: torch.nn.Module):
        self._state = state
        self._module_name = module_name
        self._module = module

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _parameters(self) -> List[Tuple[str, int]]:
        """(name, shard elements) of the module's FSDP parameters, in FSDP's order."""
        groups = self._module._get_fsdp_state()._fsdp_param_groups
        params = []
        for group in groups:
            for p in group.fsdp_params:
                name = p._param_fqn or f"{self._module_name}.{p._module_info.param_name}"
                params.append((name, p.padded_sharded_param_size.numel()))
        return params

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any = dist.ReduceOp.SUM,
                 async_op: bool = False) -> Optional[dist.Work]:
        state = self._state
        try:
            _check_group(state, group, "reduce-scatter")
            average = _is_average(op)
            if input_tensor.dtype not in _ENGINE_DTYPES:
                raise TypeError(f"terse.fsdp: gradients of {self._module_name or 'the root'} "
                                f"are {input_tensor.dtype}; terse reduces float32, float16 and "
                                "bfloat16")
            size = state.engine.size
            rows = input_tensor.view(size, -1)
            n = rows.shape[1]
            params = self._parameters()
            if sum(s for _, s in params) != n:
                # Some parameters got no gradient this step: FSDP left them out of the buffer.
                # Without a map of which, the module's gradients travel as one tensor.
                prefix = f"{self._module_name}." if self._module_name else ""
                params = [(f"{prefix}<gradients of {n} elements>", n)]
            items = []
            small = []  # (offset, elements) of the gradients that travel raw
            offset = 0
            for name, s in params:
                options = state._options_for(name, rows[:, offset:offset + s], average)
                if options.codec == "none":
                    small.append((offset, s))
                else:
                    # Parameter-major: the parameter's padded full gradient, shards in rank
                    # order; its codec state is kept under the parameter's name.
                    inp = rows[:, offset:offset + s].contiguous().view(-1)
                    out = output_tensor.view(-1)[offset:offset + s]
                    items.append((name, inp, out, options))
                offset += s
            fused = None
            if small:
                # Raw gradients carry no codec state: they travel together, one reduce-scatter
                # instead of one per bias and norm (each a round of messages between all ranks).
                # The raw sum is exact and in rank order, element by element, so fusing changes
                # no value.
                inp = torch.cat([rows[:, o:o + s] for o, s in small], dim=1).contiguous().view(-1)
                fused = torch.empty(sum(s for _, s in small), dtype=input_tensor.dtype)
                prefix = f"{self._module_name}." if self._module_name else ""
                items.append((f"{prefix}<raw gradients>", inp, fused,
                              terse.AllreduceOptions(codec="none", average=average,
                                                     hierarchy=state.hierarchy)))
            _reduce_scatter(state.engine, items)
            if fused is not None:
                out = output_tensor.view(-1)
                at = 0
                for o, s in small:
                    out[o:o + s].copy_(fused[at:at + s])
                    at += s
        except BaseException as e:
            state._record(e)
            raise
        state.reduce_scatters += 1
        return None


class AllGather:
    """FSDP2's custom all-gather (``FSDPModule.set_custom_all_gather``) for one FSDP module: the
    module's parameter shards, concatenated, gathered with ``codec`` (raw below ``min_bytes``).
    Buffers below ``min_bytes`` and of other dtypes (FSDP gathers groups of mixed dtypes as
    uint8) go through the process group unchanged, and so do gathers among a subgroup: with
    ``reshard_after_forward=R`` FSDP gathers the backward's parameters among R ranks from the
    secondary shard its forward kept, which holds the decoded values already (hpZ; exact, and
    inside the host where the R ranks share one)."""

    def __init__(self, state: "TerseFSDPState", module_name: str, codec: str):
        self._state = state
        self._name = f"{module_name}.<all-gather>" if module_name else "<all-gather>"
        self._codec = codec

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> Optional[dist.Work]:
        state = self._state
        if group.size() != state.engine.size:
            state.subgroup_gathers += 1
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                               async_op=async_op)
        if input_tensor.dtype not in _ENGINE_DTYPES:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                               async_op=async_op)
        if not state.policy.compresses(input_tensor.numel() * input_tensor.element_size()):
            # Small buffers gain nothing from a codec: FSDP's own exact gather.
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                               async_op=async_op)
        try:
            _all_gather(state.engine, self._name, input_tensor, output_tensor, self._codec,
                        state.hierarchy)
        except BaseException as e:
            state._record(e)
            raise
        state.all_gathers += 1
        return None


def ranks_per_host() -> Optional[int]:
    """The ranks each host holds, as the engine will agree on them, for FSDP2's
    ``fully_shard(module, reshard_after_forward=terse.fsdp.ranks_per_host())`` (hpZ: the
    backward's all-gathers then stay inside each host). Read before any engine exists, from the
    environment the engine reads: ``TERSE_TOPOLOGY`` (``"A,A,..."`` or ``"HxR"``), else under
    topology auto torchrun's ``LOCAL_WORLD_SIZE``. None where hosts differ in size or hold one
    rank each, or nothing says. FSDP groups consecutive ranks, so the hosts must be hosts of
    consecutive ranks (as torchrun and ``TERSE_TOPOLOGY`` make them); :func:`compress` warns
    where they are not (``state.hpz``)."""
    spec = os.environ.get("TERSE_TOPOLOGY", "auto").strip()
    try:
        if spec == "flat":
            return None
        if spec == "auto":
            counts = [int(os.environ["LOCAL_WORLD_SIZE"])] if "LOCAL_WORLD_SIZE" in os.environ \
                else []
        elif "x" in spec:
            hosts, ranks = spec.split("x")
            counts = [int(ranks)] * int(hosts)
        else:
            counts = [int(c) for c in spec.split(",")]
    except ValueError:
        return None  # the engine names a malformed TERSE_TOPOLOGY when it starts
    if not counts or len(set(counts)) != 1 or counts[0] < 2:
        return None
    return counts[0]


def _fsdp2_modules(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    from torch.distributed.fsdp import FSDPModule
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


class TerseFSDPState:
    """terse's collectives for one FSDP model; create it with :func:`compress` (FSDP2) or
    :func:`fsdp1_hook` (FSDP1).

    Knobs (every rank must pass the same values; the engine checks each tensor's plan across
    ranks on its first use):

    codec
        Codec of gradients whose parameter has at least ``min_bytes`` of gradient (FSDP's reduce
        dtype). The default, ``"minmax8:ef=1"``, sends 8 bits per element with error feedback
        (4x fewer bytes than fp32); ``"minmax8:bits=4,ef=1"`` sends 4 (ZeRO++'s qgZ width),
        ``"fp16"`` and ``"bf16"`` 16; ``"none"`` reduces raw (FSDP's result up to summation
        order). ``terse.codec_names()`` lists them. ``"auto"`` leaves the choice to the engine's
        planner, per gradient size: raw, or one of ``auto_codecs`` with the reduce-scatter
        strategy and partitions it predicts (and measures) fastest on these links; it calibrates
        when the state is created (``Engine.calibrate``: a collective of a few seconds, or the
        agreed cache).
    all_gather_codec
        Codec of the parameter all-gather (FSDP2 only), or None (or ``"none"``) to leave FSDP's
        own all-gather in place. ``"minmax8"`` (8-bit block quantization, ZeRO++'s qwZ) or ``"bf16"``. Stateless
        codecs only: the gathered weights are recomputed from the full-precision shards every
        time, so nothing accumulates. ``"auto"``: the planner's choice among raw and
        ``auto_codecs``, which must then all be stateless.
    auto_codecs
        With ``"auto"``: the codecs the planner may choose from (lossy codecs change what
        training computes, so this is yours to decide), e.g. ``["minmax8", "fp16"]``. None:
        ``TERSE_PLAN_CODECS``, else the planner's light tier (as for the DDP hook;
        docs/planner.md lists it). ``"auto:heavy"`` is refused: the state takes no heavy tier.
    min_bytes
        Gradients (and all-gather buffers) smaller than this travel raw; 64 KiB by default.
    hierarchy
        ``"auto"`` (default): reduce-scatters and all-gathers run in two levels over the job's
        hosts where it spans hosts of several ranks and the pieces are large (docs/topology.md;
        the hosts come from ``TERSE_TOPOLOGY``, ``TERSE_HOST`` or torchrun's node);
        ``"hosts"``: always; ``"flat"``: never.
    strategy, partitions, seed, threads, timeout, process_group
        As for :class:`terse.torch.TerseHookState`.

    ``codec``, ``all_gather_codec``, ``min_bytes``, ``strategy``, ``partitions``,
    ``auto_codecs`` and ``adaptive`` make the state's :class:`terse.Policy` (``state.policy``),
    as for the hook.

    Attributes: ``engine``, ``policy``, ``error`` (the first error a collective met), ``bytes_sent``,
    ``bytes_sent_across_hosts`` (the part that went to other hosts), ``reduce_scatters`` and
    ``all_gathers`` (calls so far), ``subgroup_gathers`` (backward gathers among the ranks of a
    secondary shard, through the process group), ``hpz`` (FSDP2: True where some module
    reshards after forward to groups that are exactly the engine's hosts).
    """

    def __init__(self, *, codec: str = "minmax8:ef=1", all_gather_codec: Optional[str] = None,
                 min_bytes: int = 64 << 10, strategy: str = "auto", partitions: int = 0,
                 seed: int = 0, threads: int = 0, timeout: Optional[float] = None,
                 process_group: Optional[Any] = None,
                 communicator: Optional[terse.Communicator] = None,
                 auto_codecs: Optional[Sequence[str]] = None, hierarchy: str = "auto",
                 adaptive: bool = False) -> None:
        # Validated before connecting: a typo fails on every rank alike, none waits for another.
        self.policy = terse.Policy(codec, min_bytes=min_bytes, strategy=strategy,
                                   partitions=partitions, auto_codecs=auto_codecs,
                                   all_gather_codec=all_gather_codec, door=FSDP,
                                   adaptive=adaptive)
        if hierarchy not in ("auto", "flat", "hosts"):
            raise terse.SpecError(f"terse.fsdp: unknown hierarchy {hierarchy!r} (allowed: auto, "
                                  "flat, hosts)")
        self.hierarchy = hierarchy
        self.error: Optional[BaseException] = None
        self.reduce_scatters = 0
        self.all_gathers = 0
        self.subgroup_gathers = 0
        self.hpz = False
        self._options: Dict[str, terse.AllreduceOptions] = {}
        comm = communicator if communicator is not None else communicator_for(
            process_group, timeout=timeout)
        self.engine = terse.Engine(comm, self.policy.engine_options(seed=seed, threads=threads))
        self.policy.calibrate(self.engine)

    # The policy's knobs, as given (terse.Policy).
    codec = property(lambda self: self.policy.codec)
    all_gather_codec = property(lambda self: self.policy.all_gather_codec)
    strategy = property(lambda self: self.policy.strategy)
    partitions = property(lambda self: self.policy.partitions)
    min_bytes = property(lambda self: self.policy.min_bytes)
    auto_codecs = property(lambda self: self.policy.auto_codecs)

    def _record(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def _options_for(self, name: str, grad: torch.Tensor, average: bool) -> terse.AllreduceOptions:
        key = f"{name}/{int(average)}"
        options = self._options.get(key)
        if options is None:
            options = self.policy.options_for(grad.numel() * grad.element_size(), average)
            options.hierarchy = self.hierarchy
            self._options[key] = options
        return options

    # ---- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """Error-feedback residuals and codec state of every parameter, and the settings they
        belong to. Save it with the model and optimizer; every rank saves its own."""
        self.engine.synchronize()
        return {**self.policy.state_dict(rank=self.engine.rank, size=self.engine.size),
                "engine": self.engine.save_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output of the same rank of a job of the same size and
        settings; the next steps continue bit for bit."""
        self.policy.load_state_dict(state, rank=self.engine.rank, size=self.engine.size,
                                    what="terse FSDP state")
        self.engine.synchronize()
        self.engine.load_state(state["engine"])

    @property
    def bytes_sent(self) -> int:
        return self.engine.bytes_sent

    @property
    def bytes_sent_across_hosts(self) -> int:
        return self.engine.bytes_sent_across_hosts

    def close(self) -> None:
        """Waits for outstanding collectives and releases the engine's threads and connections."""
        self.engine.close()


def compress(model: torch.nn.Module, codec: str = "minmax8:ef=1",
             all_gather_codec: Optional[str] = None, min_bytes: int = 64 << 10,
             **knobs: Any) -> TerseFSDPState:
    """Installs terse's compressed gradient reduce-scatter (and, with ``all_gather_codec``, its
    quantized parameter all-gather) on every FSDP2 module of ``model`` (``fully_shard`` applied
    to it or its submodules). Call it on every rank after ``fully_shard`` and before the first
    forward; it connects terse's own mesh through the process group's store (a collective).
    Returns the :class:`TerseFSDPState` (``state_dict``, ``bytes_sent``, ``close``)."""
    modules = _fsdp2_modules(model)
    if not modules:
        raise terse.InvalidArgument(
            "terse.fsdp.compress: the model has no FSDP2 module: apply "
            "torch.distributed.fsdp.fully_shard to it (and its layers) first")
    state = TerseFSDPState(codec=codec, all_gather_codec=all_gather_codec, min_bytes=min_bytes,
                           **knobs)
    for name, module in modules:
        module.set_custom_reduce_scatter(ReduceScatter(state, name, module))
        if all_gather_codec not in (None, "none"):
            module.set_custom_all_gather(AllGather(state, name, all_gather_codec))
    state.hpz = _secondary_shards_are_hosts(modules, state.engine)
    return state


def _secondary_shards_are_hosts(modules: List[Tuple[str, torch.nn.Module]],
                                engine: terse.Engine) -> bool:
    """Whether some FSDP2 module reshards after forward to a secondary shard (FSDP's
    ``reshard_after_forward=R``) whose groups are the engine's hosts, so that its backward
    all-gather stays inside this rank's host. Warns where such groups are not hosts: the
    results are the same, but those backward gathers cross hosts."""
    host = next(h for h in engine.hosts if engine.rank in h)
    matched = False
    for name, module in modules:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            post = group.post_forward_mesh_info
            if post is None or post == group.mesh_info:
                continue
            ranks = sorted(dist.get_process_group_ranks(post.shard_process_group))
            if ranks == sorted(host):
                matched = True
            else:
                warnings.warn(
                    f"terse.fsdp: {name or 'the root'} reshards after forward among ranks "
                    f"{ranks}, but rank {engine.rank}'s host holds ranks {sorted(host)}: its "
                    "backward all-gathers cross hosts (set reshard_after_forward to the ranks "
                    "per host, on hosts of consecutive ranks)", stacklevel=3)
    return matched


# ---- FSDP1 ---------------------------------------------------------------------------------


class _UnitState:
    """The hook state of one FSDP1 unit: the shared terse state and the unit's name."""

    def __init__(self, state: TerseFSDPState, name: str) -> None:
        self.state = state
        self.name = name


def _fsdp1_reduce_scatter(unit: _UnitState, grad: torch.Tensor,
                          output: Optional[torch.Tensor] = None) -> None:
    """FSDP1's sharded communication hook: ``grad`` is the unit's padded flat gradient (``size``
    shards), ``output`` this rank's shard of the average; without ``output`` (a world of one, or
    NO_SHARD) ``grad`` is averaged in place."""
    state = unit.state
    try:
        if grad.dtype not in _ENGINE_DTYPES:
            raise TypeError(f"terse.fsdp: gradient of {unit.name} is {grad.dtype}; terse reduces "
                            "float32, float16 and bfloat16")
        inp = grad.contiguous().view(-1)
        if output is None:
            state.engine.allreduce(unit.name, inp,
                                   **_kwargs(state._options_for(unit.name, inp, True)),
                                   hierarchy=state.hierarchy).wait()
            if inp.data_ptr() != grad.data_ptr():
                grad.copy_(inp.view_as(grad))
        else:
            _reduce_scatter(state.engine, [(unit.name, inp.clone(), output,
                                            state._options_for(unit.name, inp, True))])
    except BaseException as e:
        state._record(e)
        raise
    state.reduce_scatters += 1


def _kwargs(options: terse.AllreduceOptions) -> Dict[str, Any]:
    return {"codec": options.codec, "strategy": options.strategy,
            "partitions": options.partitions, "average": options.average}


def fsdp1_hook(model: torch.nn.Module, codec: str = "minmax8:ef=1", min_bytes: int = 64 << 10,
               **knobs: Any) -> TerseFSDPState:
    """Registers terse's reduce-scatter as the communication hook of every unit of an FSDP1 model
    (``FullyShardedDataParallel``, the root). Each unit's flat gradient is one tensor for terse,
    named after the unit's place in the module tree. Returns the :class:`TerseFSDPState`."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    if not isinstance(model, FSDP):
        raise terse.InvalidArgument("terse.fsdp.fsdp1_hook: pass the root "
                                    "FullyShardedDataParallel module")
    state = TerseFSDPState(codec=codec, min_bytes=min_bytes, **knobs)
    model.register_comm_hook(_UnitState(state, "<root>"), _fsdp1_reduce_scatter)
    # register_comm_hook gives every unit the root's state; each unit gets its own name instead,
    # so that its error feedback is keyed by where it sits in the model.
    for name, unit in model.named_modules():
        if isinstance(unit, FSDP):
            unit._comm_hook_state = _UnitState(state, f"{name or '<root>'}.flat_param")
    return state
