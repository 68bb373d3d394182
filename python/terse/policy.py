"""What a front end compresses, and with what: one policy shared by every door into the engine.

The DDP hook (:mod:`terse.torch`), FSDP (:mod:`terse.fsdp`) and the torch.distributed backend
(:mod:`terse.backend`) each build one :class:`Policy` from their knobs and ask it the same
questions; a new front end (an optimizer, DiLoCo) does the same::

    policy = terse.Policy("minmax8:ef=1", min_bytes=64 << 10, door=terse.policy.FSDP)
    engine = terse.Engine(comm, policy.engine_options(threads=4))
    policy.calibrate(engine)                          # codec "auto": calibrate at start-up
    options = policy.options_for(grad.numel() * grad.element_size())
    checkpoint = {**policy.state_dict(rank=engine.rank, size=engine.size),
                  "engine": engine.save_state()}
    policy.load_state_dict(checkpoint, rank=engine.rank, size=engine.size)

The rule: a tensor of at least ``min_bytes`` (in its own dtype's bytes) is compressed with
``codec`` (or the spec a schedule gives it), with ``strategy`` and ``partitions``; smaller ones
travel raw, exactly. Everything is validated when the policy is made, before any rank connects,
so a typo fails on every rank alike and none waits for another. Every rank must use the same
policy (the engine checks each tensor's plan across ranks on its first use).

A :class:`Door` says what a front end can honour (the tiers of codec "auto" it plans, whether
its codec may be a schedule, whether what it all-gathers is recomputed each time); the policy
refuses the rest with the reason, naming the door.
"""

import os
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import terse
from terse.accordion import Accordion, SparseWarmup

__all__ = ["Policy", "Door", "AUTO_TIERS", "ADAPTIVE_TIERS", "GENERIC", "HOOK", "FSDP",
           "BACKEND"]

# Codec "auto"'s tiers, lightest first: the planner's choice among the codecs that keep accuracy
# (auto_codecs), or among those and the ones that compress more (heavy_codecs as well).
AUTO_TIERS = ("auto", "auto:heavy")
# The default tiers where the gradients feed an adaptive optimizer (``adaptive=True``: Adam,
# AdamW and their family, which divide each element's step by a running RMS of its own
# gradient). A codec whose error is spread over a whole matrix (low rank) or chunk (1 bit)
# then moves elements of small variance by large steps; element-wise quantizers keep the light
# tier, and low rank moves to the heavy one (docs/planner.md, "Under Adam").
ADAPTIVE_TIERS = {
    "auto": ("fp16", "minmax8:ef=1"),
    "auto:heavy": ("powersgd:rank=8", "powersgd:rank=8,wire=fp16", "onebit:ef=1", "powersgd"),
}
# The version of the checkpoints front ends save through state_dict().
STATE_VERSION = 1


class Door(NamedTuple):
    """What one front end can honour."""

    # Names the front end in error messages ("terse.torch", "terse.fsdp", ...).
    name: str
    # The tiers of codec "auto" it plans; () where it plans nothing.
    tiers: Tuple[str, ...] = AUTO_TIERS
    # Why it refuses the others (said in the error).
    refused_tiers_reason: str = ""
    # Whether its codec may be a schedule (terse.Accordion, terse.SparseWarmup).
    schedules: bool = False
    # Whether what it all-gathers is recomputed from fresh shards each time (FSDP's parameters):
    # then the all-gather's codecs must keep no state between calls.
    fresh_gathers: bool = False


# A front end that plans both tiers and takes no schedule.
GENERIC = Door("terse")
# The DDP communication hook.
HOOK = Door("terse.torch", schedules=True)
# FSDP's reduce-scatter and all-gather hooks.
FSDP = Door("terse.fsdp", tiers=("auto",), fresh_gathers=True,
            refused_tiers_reason="its state takes no heavy tier (heavy_codecs): use 'auto' with "
                                 "the auto_codecs it may choose from")
# The torch.distributed backend.
BACKEND = Door("terse backend", tiers=(),
               refused_tiers_reason="the backend's policy is read from its settings, which "
                                    "name no codecs for a planner to choose from: name one, e.g. "
                                    "'fp16'")

Codec = Union[str, Accordion, SparseWarmup]


def _stateful(spec: str) -> bool:
    """Whether a codec keeps state between calls (error feedback, PowerSGD's Q)."""
    if spec == "none":
        return False
    try:
        return bool(terse.Codec(spec).traits["stateful"])
    except terse.InvalidArgument:
        return True  # terse.Codec refuses codecs that keep state or sum across ranks


class Policy:
    """Which tensors a front end compresses and how: see the module's docstring.

    codec
        The codec spec of tensors of at least ``min_bytes``: ``terse.codec_names()`` lists the
        codecs, ``"none"`` sends everything raw. ``"auto"`` leaves the choice to the engine's
        planner among raw and ``auto_codecs`` (the light tier), ``"auto:heavy"`` among those
        and ``heavy_codecs`` (the heavy tier). Where the door takes schedules, a
        :class:`terse.Accordion` or :class:`terse.SparseWarmup` of specs.
    min_bytes
        Smaller tensors travel raw (biases, norms, small buckets). 64 KiB by default.
    strategy, partitions
        How compressed tensors are reduced (``terse.strategies()``), and the pieces each is cut
        into (0: the engine chooses from the size).
    auto_codecs, heavy_codecs
        With codec ``"auto"`` (or ``all_gather_codec="auto"``) and ``"auto:heavy"``: the codecs
        each tier may choose, canonicalized. None: the planner's defaults
        (``TERSE_PLAN_CODECS`` and ``TERSE_PLAN_HEAVY_CODECS``, else the tiers docs/planner.md
        lists). Given without an "auto" codec: refused, since nothing would use them.
    all_gather_codec, all_to_all_codec
        For doors that all-gather or exchange tensors: their codecs (None: the door's default).
        Where the door's gathers are recomputed each time, stateless codecs only.
    door
        The front end's :class:`Door` (default: one that plans both tiers).
    adaptive
        True where the gradients feed an adaptive optimizer (Adam, AdamW and their family): the
        tiers given as None (or empty) get :data:`ADAPTIVE_TIERS` instead of the planner's defaults
        (unless ``TERSE_PLAN_CODECS`` / ``TERSE_PLAN_HEAVY_CODECS`` name them). Changes nothing
        where no "auto" codec is planned.

    Attributes: the knobs as given (``auto_codecs`` and ``heavy_codecs`` as canonical lists),
    ``schedule`` (the codec when it is a schedule, else None), ``planned`` (whether the planner
    decides anything: the front end calibrates at start-up).
    """

    def __init__(self, codec: Codec = "none", *, min_bytes: int = 64 << 10,
                 strategy: str = "auto", partitions: int = 0,
                 auto_codecs: Optional[Sequence[str]] = None,
                 heavy_codecs: Optional[Sequence[str]] = None,
                 all_gather_codec: Optional[str] = None,
                 all_to_all_codec: Optional[str] = None,
                 door: Door = GENERIC, adaptive: bool = False) -> None:
        self.door = door
        if not isinstance(adaptive, bool):
            raise terse.InvalidArgument(f"adaptive must be True or False, not {adaptive!r}")
        self.adaptive = adaptive
        if min_bytes < 0:
            raise terse.InvalidArgument(f"min_bytes must be >= 0, not {min_bytes}")
        self.schedule: Optional[Any] = None if isinstance(codec, str) else codec
        if self.schedule is not None and not (door.schedules
                                              and isinstance(codec, (Accordion, SparseWarmup))):
            what = "a spec, terse.Accordion or terse.SparseWarmup" if door.schedules else "a spec"
            raise terse.InvalidArgument(f"codec must be {what}, not {codec!r}")
        self.codec = codec
        self.min_bytes = min_bytes
        self.strategy = strategy
        self.partitions = partitions
        self.all_gather_codec = all_gather_codec
        self.all_to_all_codec = all_to_all_codec
        for spec in self.specs() + [all_gather_codec, all_to_all_codec]:
            if spec in AUTO_TIERS and spec not in door.tiers:
                raise terse.InvalidArgument(
                    f"{door.name}: codec {spec!r} is not supported: {door.refused_tiers_reason}")
        if all_to_all_codec in AUTO_TIERS:
            raise terse.InvalidArgument(
                f"{door.name}: all_to_all_codec {all_to_all_codec!r}: the engine's all-to-all "
                "plans nothing (each block's size differs per peer): name a codec")
        # A schedule's levels are of one family: all of them planned or none.
        self.planned = any(spec in AUTO_TIERS for spec in self.specs() + [all_gather_codec])
        for spec in self.specs() + [all_gather_codec, all_to_all_codec]:
            if spec is not None and spec not in AUTO_TIERS:
                terse.canonical_spec(spec)
        if adaptive and self.planned:  # an empty list, as None, asks for the default tier
            if not auto_codecs and not os.environ.get("TERSE_PLAN_CODECS"):
                auto_codecs = ADAPTIVE_TIERS["auto"]
            if (not heavy_codecs and "auto:heavy" in self.specs()
                    and not os.environ.get("TERSE_PLAN_HEAVY_CODECS")):
                heavy_codecs = ADAPTIVE_TIERS["auto:heavy"]
        if not self.planned:
            for knob, value in (("auto_codecs", auto_codecs), ("heavy_codecs", heavy_codecs)):
                if value is not None:
                    raise terse.InvalidArgument(f"{door.name}: {knob} is for "
                                                f"{self._where_auto()}")
        if heavy_codecs is not None and "auto:heavy" not in door.tiers:
            raise terse.InvalidArgument(f"{door.name}: heavy_codecs is for codec 'auto:heavy', "
                                        "which it does not plan")
        self.auto_codecs: List[str] = [terse.canonical_spec(c) for c in auto_codecs or ()]
        self.heavy_codecs: List[str] = [terse.canonical_spec(c) for c in heavy_codecs or ()]
        for spec in self.specs():
            terse.AllreduceOptions(codec=spec, strategy=strategy, partitions=partitions)
        self._check_gathers()

    def _where_auto(self) -> str:
        if not self.door.tiers:
            return "codec 'auto', which it does not plan"
        where = "codec=" + " or ".join(repr(t) for t in self.door.tiers)
        if self.door.fresh_gathers and "auto" in self.door.tiers:
            where += " or all_gather_codec='auto'"
        return where

    def _check_gathers(self) -> None:
        if not self.door.fresh_gathers or self.all_gather_codec is None:
            return
        if self.all_gather_codec == "auto":
            # The planner may choose any of them for a gather of parameters.
            stateful = [c for c in self.auto_codecs if _stateful(c)]
            if not self.auto_codecs or stateful:
                raise terse.InvalidArgument(
                    f"{self.door.name}: all_gather_codec 'auto' chooses among auto_codecs, which "
                    "must be given and keep no state between calls (parameters are gathered "
                    f"from fresh shards each time){': ' + ', '.join(stateful) if stateful else ''}"
                    "; e.g. auto_codecs=['minmax8', 'bf16']")
        elif _stateful(self.all_gather_codec):
            raise terse.InvalidArgument(
                f"{self.door.name}: all_gather_codec {self.all_gather_codec!r} keeps state "
                "between calls; parameters are gathered from fresh shards each time: use a "
                "stateless codec such as 'minmax8' or 'bf16'")

    # ---- what each tensor gets ---------------------------------------------------------------

    def specs(self) -> List[str]:
        """The specs compressed tensors may get: the codec, or every level of the schedule."""
        return [self.codec] if self.schedule is None else list(self.schedule.specs())

    def compresses(self, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` bytes (in its own dtype) is compressed."""
        return nbytes >= self.min_bytes

    def spec_for(self, name: str) -> str:
        """The spec of compressed tensor ``name`` now: the codec, or the schedule's level."""
        return self.codec if self.schedule is None else self.schedule.spec(name)

    def compressed_options(self, spec: Optional[str] = None, *, average: bool = True,
                           rows: int = 0) -> terse.AllreduceOptions:
        """The options of a compressed tensor: ``spec`` (default: the codec), the strategy and
        the partitions."""
        return terse.AllreduceOptions(codec=self.codec if spec is None else spec,
                                      strategy=self.strategy, partitions=self.partitions,
                                      average=average, rows=rows)

    @staticmethod
    def raw_options(average: bool = True) -> terse.AllreduceOptions:
        """The options of a tensor that travels raw: the engine's exact allreduce."""
        return terse.AllreduceOptions(codec="none", average=average)

    def options_for(self, nbytes: int, average: bool = True) -> terse.AllreduceOptions:
        """The options of a tensor of ``nbytes`` bytes under a codec spec (not a schedule)."""
        if not self.compresses(nbytes):
            return self.raw_options(average)
        return self.compressed_options(average=average)

    # ---- the engine --------------------------------------------------------------------------

    def engine_options(self, **knobs: Any) -> terse.EngineOptions:
        """EngineOptions with the policy's tiers and the given engine knobs (seed, threads, ...)."""
        return terse.EngineOptions(auto_codecs=self.auto_codecs, heavy_codecs=self.heavy_codecs,
                                   **knobs)

    def calibrate(self, engine: terse.Engine) -> None:
        """Calibrates the engine's planner now where the policy plans anything (a collective of
        a few seconds, or the agreed cache): on first use it would run inside the first
        backward pass, timed with the compute of other gradients on the same cores."""
        if self.planned:
            engine.calibrate()

    # ---- checkpoints -------------------------------------------------------------------------

    def describe(self) -> str:
        """The codec as text: its spec, or the schedule's description."""
        return self.codec if self.schedule is None else self.schedule.describe()

    def state_dict(self, *, rank: int, size: int) -> Dict[str, Any]:
        """What a checkpoint saved by rank ``rank`` of a job of ``size`` ranks under this policy
        holds besides the front end's own state (its schedule's, the engine's), which it adds to
        the same dict: the version, the policy's settings, the rank and the size."""
        return {"version": STATE_VERSION, "codec": self.describe(),
                "auto_codecs": list(self.auto_codecs), "heavy_codecs": list(self.heavy_codecs),
                "strategy": self.strategy, "min_bytes": self.min_bytes,
                "all_gather_codec": self.all_gather_codec,
                "all_to_all_codec": self.all_to_all_codec, "rank": rank, "size": size}

    def load_state_dict(self, state: Mapping[str, Any], *, rank: int, size: int,
                        what: str = "terse state",
                        settings: Optional[Mapping[str, Any]] = None,
                        absent: Optional[Mapping[str, Any]] = None) -> None:
        """Checks that ``state`` (a front end's checkpoint) was saved under this policy, by the
        same rank of a job of the same size: raises DecodeError for another version and
        MismatchError naming the first setting that differs; changes nothing. ``settings`` are
        the front end's own (e.g. warmup_steps) and ``absent`` the values of settings a
        checkpoint without them was saved with (a checkpoint of an older version of the front
        end); the policy's own knobs absent from a checkpoint count as their defaults."""
        if state.get("version") != STATE_VERSION:
            raise terse.DecodeError(
                f"{what}: version {state.get('version')!r}, expected {STATE_VERSION}")
        mine = self.state_dict(rank=rank, size=size)
        del mine["version"]
        expected = {**mine, **(settings or {})}
        defaults = {"auto_codecs": [], "heavy_codecs": [], "all_gather_codec": None,
                    "all_to_all_codec": None, **(absent or {})}
        for key, value in expected.items():
            saved = state.get(key, defaults.get(key))
            if saved != value:
                raise terse.MismatchError(
                    f"rank {rank}: {what} was saved with {key}={state.get(key)!r}, this one has "
                    f"{key}={value!r}")
