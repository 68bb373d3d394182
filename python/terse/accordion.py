"""Codec schedules for the DDP hook: a tensor's codec spec that changes during training.

:class:`Accordion` (Agarwal, Wang, Lee, Venkataraman, Papailiopoulos, "Adaptive Gradient
Communication via Critical Learning Regime Identification", MLSys 2021) compresses each tensor
lightly in critical regimes of training and heavily elsewhere. :class:`SparseWarmup` ramps a
sparsifier's density down over the first windows of training, as Deep Gradient Compression
(Lin et al., ICLR 2018) warms up.

Both are given to the hook as its codec::

    state, hook = terse.torch.ddp_hook(model, codec=terse.Accordion("powersgd:rank=1",
                                                                    "powersgd:rank=4"))

Accordion's levels may also be codec "auto"'s two accuracy tiers,
``terse.Accordion("auto:heavy", "auto")``: the planner picks each tensor's fastest plan within
the tier the controller allows (docs/planner.md).

Both count time in *windows*: an epoch (the training loop calls ``state.epoch_end()``) or
``window_steps`` communicated steps. Every rank must reach each window's end at the same step
(call ``epoch_end()`` at the same point on every rank, as any collective). A change of spec
keeps what the engine's codec state can take over: error-feedback residuals, DGC's momentum
and accumulated velocity, PowerSGD's residual (its warm start restarts when the rank changes).
Over codec "auto", where the two tiers' plans of a tensor differ in the codec alone (the same
strategy and partitions) the residual carries over as well; another strategy or partition
count starts the tensor's codec state afresh.

This module holds the decisions (pure Python, no torch): the hook (:mod:`terse.torch`)
accumulates the gradients, agrees on the norms across ranks and asks for the spec.
"""

import math
from typing import Any, Dict, List, Mapping, Optional

import terse

__all__ = ["Accordion", "SparseWarmup", "codec_family"]

# Codecs whose specs make two levels of one family: the same codec at another parameter, or the
# precision family (1 bit with error feedback against 16-bit floats).
_PRECISION = ("onebit", "fp16", "bf16")
# The n a level's bytes are compared at: a 1024 x 1024 matrix.
_PROBE_ELEMENTS = 1 << 20
# Codec "auto"'s tiers, lightest first: the planner's choice among the codecs that keep
# accuracy, or among those and the ones that compress more.
_AUTO = ("auto", "auto:heavy")


def _canonical(spec: str) -> str:
    return spec if spec in _AUTO else terse.canonical_spec(spec)


def codec_family(spec: str) -> str:
    """The family a codec spec belongs to: its codec's name, "precision" for onebit, fp16 and
    bf16, or "auto" for codec "auto"'s tiers ("auto" and "auto:heavy")."""
    if spec in _AUTO:
        return "auto"
    name = terse.canonical_spec(spec).split(":", 1)[0]
    return "precision" if name in _PRECISION else name


def _encoded_bytes(spec: str) -> int:
    """At most how many bytes ``spec`` sends for _PROBE_ELEMENTS elements (a 1024 x 1024
    matrix). Codecs with state between steps cannot be built alone (terse.Codec): their
    payloads are counted from their parameters; error feedback does not change a payload."""
    name, _, text = spec.partition(":")
    params = dict(kv.split("=", 1) for kv in text.split(",") if kv)
    if name == "powersgd":
        side = math.isqrt(_PROBE_ELEMENTS)
        return 2 * side * int(params["rank"]) * (2 if params.get("wire") == "fp16" else 4)
    if name == "dgc":  # at most 2k (index, value) pairs
        return 2 * round(float(params["ratio"]) * _PROBE_ELEMENTS) * 8
    params.pop("ef", None)
    plain = f"{name}:{','.join(f'{k}={v}' for k, v in params.items())}" if params else name
    return terse.Codec(plain).max_encoded_bytes(_PROBE_ELEMENTS)


def _check_window(window_steps: Optional[int], what: str) -> None:
    if window_steps is not None and (isinstance(window_steps, bool) or
                                     not isinstance(window_steps, int) or window_steps < 1):
        raise terse.InvalidArgument(
            f"{what}: window_steps must be a whole number of steps >= 1 (or None: a window is "
            f"an epoch, ended by state.epoch_end()), not {window_steps!r}")


class Accordion:
    """Accordion's two levels of one codec family, chosen per tensor at each window's end.

    heavy
        The spec for regular regimes: more compression, e.g. ``"powersgd:rank=1"`` or
        ``"topk:ratio=0.01,ef=1"``, or ``"auto:heavy"``.
    light
        The spec for critical regimes: less compression, e.g. ``"powersgd:rank=4"`` or
        ``"topk:ratio=0.1,ef=1"``, or ``"auto"``. Both specs are of one family (the same codec,
        onebit / fp16 / bf16, or codec "auto"'s tiers), and ``heavy`` must send fewer bytes than
        ``light`` (over auto: ``heavy="auto:heavy"``, ``light="auto"``; the planner chooses each
        tensor's codec within the tier, the hook's ``auto_codecs`` and ``heavy_codecs`` say
        which codecs each tier holds).
    eta
        The threshold on the relative change of a tensor's accumulated gradient norm between
        two windows, in (0, 1); the paper's 0.5.
    window_steps
        None: a window is an epoch, ended by ``state.epoch_end()``. Otherwise a window is this
        many communicated steps (``epoch_end()`` is then ignored).

    The rule, per tensor (the paper's Algorithm 1): over each window the hook sums the tensor's
    local, uncompressed gradients; at the window's end the norms of the sums, averaged over the
    ranks (one raw allreduce of a float per tensor, so every rank decides from the same values),
    are compared with the previous window's: a relative change ``|n - n_prev| / n_prev >= eta``
    is a critical regime and the next window uses ``light``, anything else ``heavy``. The first
    window runs ``light`` and its end counts as critical (there is nothing to compare with), so
    the first comparison decides the third window. A learning-rate drop (``state.lr_changed()``,
    or one the hook sees in an optimizer given to ``state.watch(optimizer)``) makes every
    tensor critical at once: ``light`` from the next step to the end of the window.
    """

    def __init__(self, heavy: str, light: str, *, eta: float = 0.5,
                 window_steps: Optional[int] = None) -> None:
        self.heavy = _canonical(heavy)
        self.light = _canonical(light)
        if codec_family(self.heavy) != codec_family(self.light):
            raise terse.InvalidArgument(
                f"Accordion: the levels must be two specs of one codec family (e.g. "
                f"powersgd:rank=1 and powersgd:rank=4); heavy={self.heavy} is "
                f"{codec_family(self.heavy)}, light={self.light} is {codec_family(self.light)}")
        if self.heavy == self.light:
            raise terse.InvalidArgument(f"Accordion: both levels are {self.heavy}")
        if codec_family(self.heavy) == "auto":
            if self.heavy != "auto:heavy":
                raise terse.InvalidArgument(
                    f"Accordion: over codec auto the heavy level is auto:heavy and the light one "
                    f"auto, not heavy={self.heavy}, light={self.light} (swap them)")
        else:
            heavy_bytes, light_bytes = _encoded_bytes(self.heavy), _encoded_bytes(self.light)
            if heavy_bytes >= light_bytes:
                raise terse.InvalidArgument(
                    f"Accordion: heavy={self.heavy} sends {heavy_bytes} bytes for "
                    f"{_PROBE_ELEMENTS} elements, light={self.light} {light_bytes}: the heavy "
                    "level must compress more (swap them)")
        if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 < eta < 1:
            raise terse.InvalidArgument(f"Accordion: eta must be in (0, 1), not {eta!r}")
        _check_window(window_steps, "Accordion")
        self.eta = float(eta)
        self.window_steps = window_steps
        # What the controller has decided.
        self.critical: Dict[str, bool] = {}  # per tensor, for the current window; absent: True
        self.previous: Dict[str, float] = {}  # per tensor, the last window's norm
        self.windows = 0  # windows ended
        self.all_critical = False  # a learning-rate drop: every tensor light until the window ends

    def describe(self) -> str:
        """The settings, as every rank must have them."""
        window = "epoch" if self.window_steps is None else f"{self.window_steps} steps"
        return (f"Accordion(heavy={self.heavy}, light={self.light}, eta={self.eta!r}, "
                f"window={window})")

    __repr__ = describe

    def specs(self) -> List[str]:
        return [self.heavy, self.light]

    def spec(self, name: str) -> str:
        """The spec tensor ``name`` uses now."""
        if self.all_critical or self.critical.get(name, True):
            return self.light
        return self.heavy

    @property
    def needs_norms(self) -> bool:
        return True

    def is_critical(self, norm: float, previous: Optional[float]) -> bool:
        """Whether a window whose accumulated gradient has this norm, after one of norm
        ``previous`` (None: the first window), was critical."""
        if previous is None or not math.isfinite(previous) or not math.isfinite(norm):
            return True
        if previous == 0.0:
            return norm != 0.0
        return abs(norm - previous) / previous >= self.eta

    def end_window(self, norms: Mapping[str, float]) -> None:
        """Decides the next window's level of every tensor from its accumulated gradient's norm
        over the window that ended (the same values on every rank)."""
        for name, norm in norms.items():
            norm = float(norm)
            self.critical[name] = self.is_critical(norm, self.previous.get(name))
            self.previous[name] = norm
        self.windows += 1
        self.all_critical = False

    def lr_dropped(self) -> None:
        """Every tensor is critical until the current window ends."""
        self.all_critical = True

    def state_dict(self) -> Dict[str, Any]:
        return {"describe": self.describe(), "critical": dict(self.critical),
                "previous": dict(self.previous), "windows": self.windows,
                "all_critical": self.all_critical}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("describe") != self.describe():
            raise terse.MismatchError(
                f"Accordion state was saved by {state.get('describe')}, this is "
                f"{self.describe()}")
        self.critical = dict(state["critical"])
        self.previous = {k: float(v) for k, v in state["previous"].items()}
        self.windows = int(state["windows"])
        self.all_critical = bool(state["all_critical"])


class SparseWarmup:
    """A sparsifier (``topk``, ``randomk`` or ``dgc``) whose density is ramped down over the
    first ``stages`` windows, as DGC's warm-up training does: window w < stages sends density
    ``max(ratio, 0.25 ** (w + 1))`` (sparsity 75%, 93.75%, 98.4375%, 99.6%, ...), later windows
    the spec's own ``ratio``.

    spec
        The sparsifier at its final density, e.g. ``"dgc:ratio=0.001"`` or
        ``"topk:ratio=0.01,ef=1"``.
    stages
        Windows of warm-up (the paper: 4 epochs).
    window_steps
        None: a window is an epoch, ended by ``state.epoch_end()``; else this many communicated
        steps.

    The ramp changes the spec, not the codec: the residual (or DGC's momentum and velocity)
    carries from one density to the next, so nothing already accumulated is lost, and the
    wire format and decoder checks stay those of a fixed ratio.
    """

    CODECS = ("topk", "randomk", "dgc")

    def __init__(self, spec: str, *, stages: int = 4, window_steps: Optional[int] = None) -> None:
        self.target = terse.canonical_spec(spec)
        name, _, params = self.target.partition(":")
        if name not in self.CODECS:
            raise terse.InvalidArgument(
                f"SparseWarmup: {self.target} is not a sparsifier with a ratio ("
                f"{', '.join(self.CODECS)})")
        self._name = name
        self._params = [kv for kv in params.split(",") if kv]
        self.ratio = float(dict(kv.split("=", 1) for kv in self._params)["ratio"])
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 0:
            raise terse.InvalidArgument(f"SparseWarmup: stages must be >= 0, not {stages!r}")
        _check_window(window_steps, "SparseWarmup")
        self.stages = stages
        self.window_steps = window_steps
        self.windows = 0

    def describe(self) -> str:
        window = "epoch" if self.window_steps is None else f"{self.window_steps} steps"
        return f"SparseWarmup({self.target}, stages={self.stages}, window={window})"

    __repr__ = describe

    def ratio_of(self, window: int) -> float:
        """The density window ``window`` sends."""
        if window >= self.stages:
            return self.ratio
        return max(self.ratio, 0.25 ** (window + 1))

    def spec_of(self, window: int) -> str:
        ratio = self.ratio_of(window)
        if ratio == self.ratio:
            return self.target
        params = [f"ratio={ratio!r}" if kv.startswith("ratio=") else kv for kv in self._params]
        return terse.canonical_spec(f"{self._name}:{','.join(params)}")

    def specs(self) -> List[str]:
        return sorted({self.spec_of(w) for w in range(self.stages + 1)})

    def spec(self, name: str) -> str:
        return self.spec_of(self.windows)

    @property
    def needs_norms(self) -> bool:
        return False

    def end_window(self, norms: Mapping[str, float]) -> None:
        self.windows += 1

    def lr_dropped(self) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {"describe": self.describe(), "windows": self.windows}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("describe") != self.describe():
            raise terse.MismatchError(
                f"SparseWarmup state was saved by {state.get('describe')}, this is "
                f"{self.describe()}")
        self.windows = int(state["windows"])
