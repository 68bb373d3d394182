"""terse: compression-aware collective communication for distributed deep learning.

The C++ core (codecs, Gloo transport, the asynchronous allreduce engine) as a Python module::

    import terse
    comm = terse.Communicator.from_env()           # torchrun's RANK, WORLD_SIZE, MASTER_*
    with terse.Engine(comm) as engine:
        handle = engine.allreduce("grad", tensor, codec="onebit:ef=1")
        handle.wait()                              # tensor now holds the average, in place

PyTorch integration lives in :mod:`terse.torch` (imported separately, since importing torch
takes a second): ``terse.torch.ddp_hook`` is a DistributedDataParallel communication hook, and
``terse.torch.pipeline`` splits a model into pipeline stages, one process each, that exchange
compressed activations and gradients through :class:`terse.Channel`. :mod:`terse.fsdp`
compresses FSDP's reduce-scatter and all-gather, and importing :mod:`terse.backend` registers
terse as the torch.distributed backend ``"cpu:terse"`` (docs/fsdp.md). The hook's codec may also
be a schedule (:mod:`terse.accordion`): :class:`Accordion`'s adaptive levels or a sparsifier's
:class:`SparseWarmup`. Every front end decides what it compresses through one
:class:`Policy` (:mod:`terse.policy`). :mod:`terse.optim` (imported separately: it imports torch)
holds optimizers that communicate themselves: ``terse.optim.OneBitAdam`` and
``terse.optim.ZeroOneAdam`` exchange their momentum 1-bit compressed (docs/python.md).
:mod:`terse.diloco` (imported separately) synchronizes every H steps: ``DiLoCo`` averages
pseudo-gradients through the engine with a codec, in fragments overlapped with inner steps
(Streaming DiLoCo; docs/diloco.md). :class:`Checkpointer` (:mod:`terse.checkpoint`) writes
periodic per-rank checkpoints and resumes a restarted job from the newest complete one.

Errors are :class:`terse.Error` subclasses carrying the C++ message (rank, tensor, peer):
SpecError, InvalidArgument, DecodeError, MismatchError, TimeoutError, TransportError and its
AuthenticationError (a store or peer did not prove the job secret; docs/security.md).
"""

from terse._C import (
    AllreduceOptions,
    AuthenticationError,
    Channel,
    Codec,
    Communicator,
    DecodeError,
    Engine,
    EngineOptions,
    Error,
    Handle,
    InvalidArgument,
    MismatchError,
    SpecError,
    Store,
    TensorPlan,
    TimeoutError,
    TransportError,
    __version__,
    bootstrap_from_env,
    canonical_spec,
    codecs,
    default_timeout,
    file_store,
    prefix_store,
    python_store,
    strategies,
    tcp_store,
)
from terse.accordion import Accordion, SparseWarmup
from terse.policy import Policy
from terse.checkpoint import Checkpointer

__all__ = [
    "Accordion",
    "AllreduceOptions",
    "AuthenticationError",
    "Channel",
    "Checkpointer",
    "Codec",
    "Communicator",
    "DecodeError",
    "Engine",
    "EngineOptions",
    "Error",
    "Handle",
    "InvalidArgument",
    "MismatchError",
    "Policy",
    "SparseWarmup",
    "SpecError",
    "Store",
    "TensorPlan",
    "TimeoutError",
    "TransportError",
    "__version__",
    "bootstrap_from_env",
    "canonical_spec",
    "codec_names",
    "codecs",
    "default_timeout",
    "file_store",
    "prefix_store",
    "python_store",
    "strategies",
    "tcp_store",
]


def codec_names() -> list:
    """Names of the registered codecs ("none", "fp16", "onebit", ...)."""
    return [c["name"] for c in codecs()]
