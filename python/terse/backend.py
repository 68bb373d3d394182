"""terse as a torch.distributed backend: ``init_process_group(backend="cpu:terse")``.

Importing this module registers the backend "terse" for CPU tensors::

    import terse.backend
    torch.distributed.init_process_group(backend="cpu:terse")   # or backend="terse"
    model = DistributedDataParallel(model)                       # no hook needed

Every collective of that process group then runs through terse (python/backend/
terse_backend.cpp, a ``c10d::Backend`` built against this torch): allreduce (SUM, AVG),
broadcast, all_gather and all_gather_into_tensor, reduce_scatter and reduce_scatter_tensor,
all_to_all and all_to_all_single, barrier. Everything else (send/recv, gather, scatter, reduce,
MIN/MAX/PRODUCT/PREMUL_SUM, coalesced and sparse variants, non-CPU tensors) raises
NotImplementedError naming the operation; never a wrong result. Use ``"cpu:terse,cuda:nccl"``
for GPU tensors.

What is compressed (the group's :class:`terse.Policy`, :func:`policy_from_settings`), read from
the environment when a group is created, or from :func:`configure` called before it; codec
``"auto"`` is refused (these settings name no codecs for a planner to choose from):

``TERSE_BACKEND_CODEC`` (default ``fp16``)
    Codec of float32/float16/bfloat16 reductions (allreduce, reduce_scatter) of at least
    ``TERSE_BACKEND_MIN_BYTES``; ``none`` sends every reduction raw.
``TERSE_BACKEND_ALL_GATHER_CODEC`` (default ``none``)
    Codec of all-gathers of float tensors of at least that size (lossy codecs give every rank
    the same decoded values).
``TERSE_BACKEND_ALL_TO_ALL_CODEC`` (default: ``TERSE_BACKEND_CODEC``'s value)
    Codec of the blocks of float all-to-alls (``all_to_all``, ``all_to_all_single``) of at least
    that size: each such block is encoded once by its sender and decoded by its receiver through
    terse's engine (a rank's block to itself stays exact); smaller blocks travel raw. A block's
    size is known alike to its sender and its receiver, so both choose alike with uneven splits
    too. ``none`` sends every block raw.
``TERSE_BACKEND_MIN_BYTES`` (default 65536)
    Smaller tensors travel raw: biases, norms, DDP's small buckets, and every metadata exchange.
``TERSE_BACKEND_THREADS`` (default 0: terse's default)
    Engine worker threads.

Integer, bool and float64 tensors always travel raw (reductions gather them and sum in rank
order, identically on every rank). Calls made inside ``with terse.backend.exact():`` travel raw
whatever their size. Broadcast and barrier always move bytes unchanged.

The extension needs torch >= 2.6 (the pinned 2.15); with an older torch (Debian's 1.13) importing
this module raises ImportError saying so.
"""

import contextlib
import datetime
import os
from typing import Iterator, Optional, Union

import torch
import torch.distributed as dist

import terse
from terse.policy import BACKEND

_MIN_TORCH = (2, 6)
_version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if _version < _MIN_TORCH:
    raise ImportError(
        f"terse.backend needs torch >= {'.'.join(map(str, _MIN_TORCH))} (the extension is built "
        f"against the venv's torch); this is torch {torch.__version__}")
try:
    from terse import _backend
except ImportError as e:
    raise ImportError(
        "terse.backend: the extension terse._backend was not built (it is built when the "
        "interpreter terse is built for has torch >= 2.6 with its C++ headers; pip builds it "
        f"with --no-build-isolation): {e}") from e

__all__ = ["configure", "exact", "policy_from_settings", "process_group", "NAME"]

NAME = "terse"

_settings: dict = {}


def configure(codec: Optional[str] = None, all_gather_codec: Optional[str] = None,
              min_bytes: Optional[int] = None, threads: Optional[int] = None,
              all_to_all_codec: Optional[str] = None) -> None:
    """Sets the policy of groups created afterwards (overrides the environment). Every rank must
    use the same values."""
    for key, value in (("codec", codec), ("all_gather_codec", all_gather_codec),
                       ("all_to_all_codec", all_to_all_codec), ("min_bytes", min_bytes),
                       ("threads", threads)):
        if value is not None:
            _settings[key] = value


def _setting(key: str, env: str, default: str) -> str:
    return str(_settings.get(key, os.environ.get(env, default)))


@contextlib.contextmanager
def exact() -> Iterator[None]:
    """Collectives this thread calls inside the block travel raw (uncompressed)."""
    previous = _backend.exact()
    _backend.set_exact(True)
    try:
        yield
    finally:
        _backend.set_exact(previous)


def _create(store: dist.Store, rank: int, size: int,
            timeout: datetime.timedelta) -> "_backend.TerseBackend":
    policy = policy_from_settings()
    try:
        threads = int(_setting("threads", "TERSE_BACKEND_THREADS", "0"))
    except ValueError as e:
        raise terse.InvalidArgument(
            f"terse backend: TERSE_BACKEND_THREADS is not a number: {e}") from e
    seconds = timeout.total_seconds() if timeout is not None else 0.0
    if os.environ.get("TERSE_TIMEOUT"):
        seconds = 0.0  # terse's own default: TERSE_TIMEOUT
    # The extension applies the policy per call (python/backend/terse_backend.cpp).
    return _backend.TerseBackend(store, rank, size, policy.codec, policy.all_gather_codec,
                                 policy.all_to_all_codec, policy.min_bytes, threads, seconds)


def process_group(store: dist.Store, rank: int, size: int,
                  timeout: Union[datetime.timedelta, float, None] = None) -> dist.ProcessGroup:
    """A process group of ``size`` ranks on the terse backend, connected over ``store`` (every
    rank calls it with the same store contents and its own ``rank``), without
    ``init_process_group``: no default group, no fixed world, as many groups as asked for (each
    over its own store or key prefix). Its policy is the one a group created now gets
    (:func:`policy_from_settings`: :func:`configure`, then the environment); ``timeout`` (a
    timedelta or seconds) bounds every wait, unless ``TERSE_TIMEOUT`` is set. terse.elastic
    makes one per generation (:class:`terse.elastic.ElasticBackendDDP`).

    Give it to ``DistributedDataParallel(model, process_group=...)``, or call its methods
    (``group.allreduce([t]).wait()``). torch.distributed does not know it by name: functions
    that look a group up in its world (``dist.get_rank(group)``) do not take it."""
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    backend = _create(store, rank, size, timeout)
    group = dist.ProcessGroup(store, rank, size)
    custom = dist.ProcessGroup.BackendType.CUSTOM
    group._register_backend(torch.device("cpu"), custom, backend)
    group._set_default_backend(custom)
    return group


def policy_from_settings() -> terse.Policy:
    """The :class:`terse.Policy` a group created now gets, from :func:`configure` and the
    environment. A bad setting fails here, on every rank alike, before any rank connects."""
    codec = _setting("codec", "TERSE_BACKEND_CODEC", "fp16")
    try:
        min_bytes = int(_setting("min_bytes", "TERSE_BACKEND_MIN_BYTES", str(64 << 10)))
    except ValueError as e:
        raise terse.InvalidArgument(
            f"terse backend: TERSE_BACKEND_MIN_BYTES is not a number: {e}") from e
    return terse.Policy(
        codec, min_bytes=min_bytes,
        all_gather_codec=_setting("all_gather_codec", "TERSE_BACKEND_ALL_GATHER_CODEC", "none"),
        all_to_all_codec=_setting("all_to_all_codec", "TERSE_BACKEND_ALL_TO_ALL_CODEC", codec),
        door=BACKEND)


if NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(NAME, _create, devices=["cpu"])
