"""Automatic resume: periodic per-rank checkpoints that a restarted job finds and loads.

For jobs that choose restarts (``torchrun --max-restarts N``): every ``every`` steps each rank
writes its own checkpoint of the model, the optimizer, the terse front end's state (error
feedback differs by rank), the caller's data position and its random streams; after a restart
:meth:`Checkpointer.resume` finds the newest checkpoint every rank completed, checks it and
loads it, and training continues from its step::

    checkpoint = terse.Checkpointer("ckpt/", every=50, keep=2, model=model,
                                    optimizer=optimizer, terse_state=state)
    start, data = checkpoint.resume()          # (0, {}) when there is none
    for step in range(start, total_steps):
        ...                                     # one training step
        checkpoint.step(step + 1, data={"epoch": epoch, "position": i + 1})

The layout, in ``directory``: one folder per checkpoint, ``step-0000000050/``, holding one file
per rank, ``rank-00003.ckpt``. Each file is written to a temporary name in that folder, flushed
to disk and renamed: a file under its final name is complete, and is its rank's mark that it is.
A checkpoint is complete when the files of every rank of the job are there, so a rank killed
while writing leaves the checkpoint incomplete, and resume takes the one before. Rank 0 keeps
the newest ``keep`` complete checkpoints and deletes the older ones (and the remains of
incomplete ones older than those).

A file is ``MAGIC``, the length of its header (4 bytes, little-endian), the header (JSON: the
format version, rank, world size, step, the names of the objects saved, the terse front ends'
settings and their fingerprint, the payload's size and sha256) and the payload (``torch.save``
of the objects' state dicts, the data position and the random streams). Before loading, a rank
checks its own file: a damaged one (not a checkpoint, truncated, checksum mismatch) raises
:class:`terse.DecodeError`; one saved by another rank, by a job of another world size, with
other objects or under another codec or policy raises :class:`terse.MismatchError`; the message
names the file and what differs. With torch.distributed initialized the ranks agree on the step
they resume from and raise alike; the payload is unpickled (``torch.load`` with
``weights_only=False``), so load checkpoints you wrote yourself only.

docs/python.md ("Automatic resume") has the lines a user adds, the launch and the limits.
"""

import hashlib
import io
import json
import os
import random
import re
import struct
import sys
from typing import Any, Dict, List, Mapping, NamedTuple, Optional

import terse

__all__ = ["Checkpointer", "Resumed", "FORMAT_VERSION", "MAGIC", "read_header", "verify"]

# The first bytes of every checkpoint file, and the version of what follows them.
MAGIC = b"terse checkpoint\n"
FORMAT_VERSION = 1

_STEP_DIR = re.compile(r"^step-(\d{10})$")
_RANK_FILE = re.compile(r"^rank-(\d{5})\.ckpt$")
_TEMP_FILE = re.compile(r"^\.rank-\d{5}\.ckpt\.tmp-\d+$")
# Header placeholders as long as any real value, so that the final header fits their space.
_PLACEHOLDER_BYTES = 10 ** 19
_PLACEHOLDER_SHA = "0" * 64
_HEADER_LIMIT = 1 << 24
_CHUNK = 1 << 20


def _step_directory(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:010d}")


def _rank_file(directory: str, step: int, rank: int) -> str:
    return os.path.join(_step_directory(directory, step), f"rank-{rank:05d}.ckpt")


def _fsync_directory(path: str) -> None:
    """Makes a rename or a new entry in ``path`` durable (where the platform allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _HashingWriter:
    """What ``torch.save`` writes into: passes bytes on to ``f`` and hashes them."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self._f.write(view)
        self.bytes += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


class _Slice(io.RawIOBase):
    """The payload of a checkpoint file, seekable from 0, for ``torch.load`` (a zip archive
    whose offsets count from its own start)."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


def _damaged(path: str, what: str) -> terse.DecodeError:
    return terse.DecodeError(f"terse.checkpoint: {path} is damaged: {what}; delete its "
                             "step folder to resume from the checkpoint before it")


def read_header(path: str) -> Dict[str, Any]:
    """The header of checkpoint file ``path`` (without reading its payload), with ``offset``,
    where the payload starts, added. Raises DecodeError if it is not a checkpoint of this
    format or its header is damaged."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 4)
        if head[:len(MAGIC)] != MAGIC:
            if len(head) < len(MAGIC) and MAGIC.startswith(head):
                raise _damaged(path, f"truncated after {len(head)} bytes")
            raise terse.DecodeError(f"terse.checkpoint: {path} is not a terse checkpoint")
        if len(head) < len(MAGIC) + 4:
            raise _damaged(path, f"truncated after {len(head)} bytes")
        (length,) = struct.unpack("<I", head[len(MAGIC):])
        if length > _HEADER_LIMIT:
            raise _damaged(path, f"a header of {length} bytes")
        text = f.read(length)
    if len(text) < length:
        raise _damaged(path, f"truncated in its header ({len(text)} of {length} bytes)")
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _damaged(path, f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a JSON object")
    if header.get("format") != FORMAT_VERSION:
        raise terse.DecodeError(f"terse.checkpoint: {path} has format "
                                f"{header.get('format')!r}; this terse reads format "
                                f"{FORMAT_VERSION}")
    missing = [k for k in ("rank", "world_size", "step", "objects", "terse", "payload_bytes",
                           "payload_sha256") if k not in header]
    if missing:
        raise _damaged(path, f"its header has no {missing[0]!r}")
    header["offset"] = len(MAGIC) + 4 + length
    return header


def verify(path: str, header: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Checks that the payload of ``path`` is whole: its size and sha256 are the header's.
    Returns the header; raises DecodeError naming the file otherwise."""
    header = read_header(path) if header is None else header
    expected, offset = int(header["payload_bytes"]), header["offset"]
    size = os.path.getsize(path)
    if size != offset + expected:
        what = "truncated" if size < offset + expected else "longer than its header says"
        raise _damaged(path, f"{what}: {size - offset} payload bytes, the header says {expected}")
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            sha.update(chunk)
    if sha.hexdigest() != header["payload_sha256"]:
        raise _damaged(path, f"its payload's sha256 is {sha.hexdigest()}, the header says "
                             f"{header['payload_sha256']}")
    return header


def _settings(obj: Any) -> Optional[Dict[str, Any]]:
    """The settings of a terse front end (an object with a :class:`terse.Policy` as ``policy``:
    the DDP hook's state, FSDP's, DiLoCo, the optimizers) that its state depends on: its class
    and its policy's codec, tiers, strategy and ``min_bytes``. None for other objects."""
    policy = getattr(obj, "policy", None)
    if not isinstance(policy, terse.Policy):
        return None
    settings = policy.state_dict(rank=0, size=0)
    for key in ("version", "rank", "size"):
        del settings[key]
    kind = type(obj)
    return {"front end": f"{kind.__module__}.{kind.__qualname__}", **settings}


def _fingerprint(settings: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _random_streams() -> Dict[str, Any]:
    import torch

    streams: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        streams["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        streams["cuda"] = torch.cuda.get_rng_state_all()
    return streams


def _restore_random_streams(streams: Mapping[str, Any]) -> None:
    import torch

    torch.set_rng_state(streams["torch"])
    random.setstate(streams["python"])
    if "numpy" in streams:
        import numpy

        numpy.random.set_state(streams["numpy"])
    if "cuda" in streams and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(streams["cuda"])


def _load_kwargs() -> Dict[str, Any]:
    import inspect

    import torch

    # torch >= 2.6 unpickles tensors only by default; the payload holds RNG states and the
    # caller's data too.
    return ({"weights_only": False}
            if "weights_only" in inspect.signature(torch.load).parameters else {})


class Resumed(NamedTuple):
    """What :meth:`Checkpointer.resume` returns: the step to continue from (the number of steps
    done) and the data position saved with it (``{}`` when starting afresh)."""

    step: int
    data: Dict[str, Any]


class _Peers:
    """How the ranks agree: torch.distributed (gather and barrier), a terse communicator
    (barrier only), or nothing (one rank, or ranks given by hand)."""

    def __init__(self, rank: int, size: int, group: Any = None, communicator: Any = None) -> None:
        self.rank, self.size = rank, size
        self._group, self._communicator = group, communicator

    def gather(self, value: Any) -> Optional[List[Any]]:
        """Every rank's ``value`` in rank order, or None where the ranks cannot exchange."""
        if self._group is None:
            return [value] if self.size == 1 else None
        import torch.distributed as dist

        values: List[Any] = [None] * self.size
        dist.all_gather_object(values, value, group=self._group)
        return values

    def barrier(self) -> None:
        if self._group is not None:
            import torch.distributed as dist

            dist.barrier(group=self._group)
        elif self._communicator is not None:
            self._communicator.barrier("terse.checkpoint")


class Checkpointer:
    """Periodic checkpoints of a training job, and the resume after a restart; see the module's
    docstring. Every rank makes one with the same arguments.

    directory
        Where the checkpoints go: one folder per step. Every rank must see the same directory
        (one machine, or a filesystem they share).
    every
        :meth:`step` saves when the step count is a multiple of ``every``.
    keep
        How many complete checkpoints rank 0 keeps; older ones are deleted.
    model, optimizer, terse_state
        What is saved and restored: anything with ``state_dict()`` and ``load_state_dict()``.
        ``terse_state`` is a terse front end's state: the DDP hook's ``TerseHookState``, FSDP's,
        a ``terse.diloco.DiLoCo``; a terse optimizer (``terse.optim.OneBitAdam``) is the
        optimizer and its own terse state. Their settings (class, codec, tiers, strategy,
        ``min_bytes``) are written in each file's header, and a checkpoint saved under others is
        refused.
    extra
        More objects to save and restore, by name: an LR scheduler, a GradScaler, ...
    random_streams
        Save and restore this rank's random streams (torch's, Python's ``random``, numpy's when
        it is imported, CUDA's when it is in use), so that a resumed run draws the same numbers
        (dropout, augmentation) as one that was not interrupted.
    process_group
        The ranks that agree (default: torch.distributed's world, when initialized).
    rank, world_size
        Given by hand (both, without torch.distributed): the ranks then agree through nothing
        but the directory. Otherwise torch.distributed's, else those of the terse front end's
        engine (which also provides a barrier), else one rank.

    Attributes: ``directory``, ``every``, ``keep``, ``resumed_from`` (the step :meth:`resume`
    loaded, or None), ``saved`` (the last step saved, or None).
    """

    def __init__(self, directory: str, *, every: int, keep: int = 2,
                 model: Optional[Any] = None, optimizer: Optional[Any] = None,
                 terse_state: Optional[Any] = None, extra: Optional[Mapping[str, Any]] = None,
                 random_streams: bool = True, process_group: Optional[Any] = None,
                 rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
        if not isinstance(every, int) or every < 1:
            raise terse.InvalidArgument(f"terse.checkpoint: every must be a whole number >= 1, "
                                        f"not {every!r}")
        if not isinstance(keep, int) or keep < 1:
            raise terse.InvalidArgument(f"terse.checkpoint: keep must be a whole number >= 1, "
                                        f"not {keep!r}")
        if (rank is None) != (world_size is None):
            raise terse.InvalidArgument("terse.checkpoint: give rank and world_size together")
        if world_size is not None and not 0 <= rank < world_size:
            raise terse.InvalidArgument(f"terse.checkpoint: rank {rank} is not in "
                                        f"0..{world_size - 1}")
        self.directory = os.fspath(directory)
        self.every = every
        self.keep = keep
        self.random_streams = random_streams
        self._objects: Dict[str, Any] = {}
        for name, obj in (("model", model), ("optimizer", optimizer),
                          ("terse_state", terse_state),
                          *((f"extra.{k}", v) for k, v in (extra or {}).items())):
            if obj is None:
                continue
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise terse.InvalidArgument(
                    f"terse.checkpoint: {name} ({type(obj).__name__}) has no state_dict() and "
                    "load_state_dict()")
            self._objects[name] = obj
        self._process_group = process_group
        self._rank, self._world_size = rank, world_size
        self.resumed_from: Optional[int] = None
        self.saved: Optional[int] = None

    # ---- who this rank is ------------------------------------------------------------------

    def _peers(self) -> _Peers:
        try:
            import torch.distributed as dist

            initialized = dist.is_available() and dist.is_initialized()
        except ImportError:
            initialized = False
        if self._rank is not None:
            if initialized:
                raise terse.InvalidArgument(
                    "terse.checkpoint: rank and world_size are for jobs without "
                    "torch.distributed; with it initialized, they are its group's")
            return _Peers(self._rank, self._world_size)
        if initialized:
            group = self._process_group if self._process_group is not None else dist.group.WORLD
            rank = dist.get_rank(group)
            if rank < 0:
                raise terse.InvalidArgument(f"terse.checkpoint: rank {dist.get_rank()} is not a "
                                            "member of the process group it was given")
            return _Peers(rank, dist.get_world_size(group), group=group)
        if self._process_group is not None:
            raise terse.InvalidArgument("terse.checkpoint: process_group given but "
                                        "torch.distributed is not initialized")
        for obj in self._objects.values():
            engine = getattr(obj, "engine", None)
            if isinstance(engine, terse.Engine) and not engine.closed:
                return _Peers(engine.rank, engine.size, communicator=engine.communicator)
        return _Peers(0, 1)

    def _terse_settings(self) -> Dict[str, Any]:
        found = {name: _settings(obj) for name, obj in self._objects.items()}
        return {name: s for name, s in found.items() if s is not None}

    # ---- what is in the directory ----------------------------------------------------------

    def _listing(self) -> Dict[int, Dict[int, str]]:
        """Each step folder's rank files: {step: {rank: path}}."""
        listing: Dict[int, Dict[int, str]] = {}
        try:
            entries = os.listdir(self.directory)
        except FileNotFoundError:
            return listing
        for entry in entries:
            match = _STEP_DIR.match(entry)
            if not match:
                continue
            files: Dict[int, str] = {}
            folder = os.path.join(self.directory, entry)
            try:
                names = os.listdir(folder)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                rank_match = _RANK_FILE.match(name)
                if rank_match:
                    files[int(rank_match.group(1))] = os.path.join(folder, name)
            listing[int(match.group(1))] = files
        return listing

    @staticmethod
    def _complete(listing: Mapping[int, Mapping[int, str]], size: int) -> List[int]:
        """The steps whose folder holds the file of every rank of ``size``, newest first."""
        return sorted((s for s, files in listing.items() if all(r in files for r in range(size))),
                      reverse=True)

    def complete_steps(self) -> List[int]:
        """The steps of the complete checkpoints in the directory, as this rank sees it, newest
        first."""
        return self._complete(self._listing(), self._peers().size)

    def _delete(self, step: int) -> None:
        """Deletes a step folder's checkpoint files (and their temporary files), then the folder
        if nothing else is in it."""
        folder = _step_directory(self.directory, step)
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return
        for name in names:
            if _RANK_FILE.match(name) or _TEMP_FILE.match(name):
                try:
                    os.unlink(os.path.join(folder, name))
                except FileNotFoundError:
                    pass
        try:
            os.rmdir(folder)
        except OSError:
            pass

    # ---- checks ----------------------------------------------------------------------------

    def _check_header(self, path: str, header: Mapping[str, Any], peers: _Peers, *,
                      step: int, own: bool) -> None:
        """Raises if ``header`` (of ``path``, in the folder of ``step``) is not a checkpoint
        this job could load: DecodeError for a file in the wrong folder, MismatchError naming
        what differs. ``own``: the file must be this rank's."""
        where = f"terse.checkpoint: {path}"
        if header["step"] != step:
            raise terse.DecodeError(f"{where} holds step {header['step']!r} but is in the folder "
                                    f"of step {step}")
        if own and header["rank"] != peers.rank:
            raise terse.MismatchError(
                f"{where} holds the state of rank {header['rank']!r}, and this is rank "
                f"{peers.rank}: error feedback and random streams are per rank, so each rank "
                "loads its own file")
        if header["world_size"] != peers.size:
            raise terse.MismatchError(
                f"{where} was saved by a job of world size {header['world_size']!r}, and this "
                f"one has world size {peers.size}: a job resumes with the world size it saved "
                "with (start afresh in another directory to change it)")
        objects = sorted(self._objects)
        if header["objects"] != objects:
            raise terse.MismatchError(
                f"{where} holds the state of {', '.join(header['objects']) or 'nothing'}, and "
                f"this Checkpointer saves {', '.join(objects) or 'nothing'}")
        mine = self._terse_settings()
        saved = header["terse"]
        if header.get("fingerprint") == _fingerprint(mine) and saved == mine:
            return
        for name in sorted(set(saved) | set(mine)):
            theirs, ours = saved.get(name, {}), mine.get(name, {})
            for key in list(ours) + [k for k in theirs if k not in ours]:
                if theirs.get(key) != ours.get(key):
                    raise terse.MismatchError(
                        f"{where} was saved with {name} {key}={theirs.get(key)!r}, and this run "
                        f"has {key}={ours.get(key)!r}: terse state (error feedback, codec state) "
                        "is only valid under the settings it was made with")
        raise terse.MismatchError(f"{where}: the fingerprint of its terse settings differs")

    # ---- saving ----------------------------------------------------------------------------

    def step(self, step: int, *, data: Optional[Mapping[str, Any]] = None) -> bool:
        """Call after each training step with the number of steps done: saves a checkpoint when
        it is a multiple of ``every`` (on every rank: each saves its own). ``data`` is the data
        position to resume from (e.g. ``{"epoch": e, "position": batches done in it}``), given
        back by :meth:`resume`. Returns whether it saved."""
        if step <= 0 or step % self.every or step == self.saved:
            return False
        self.save(step, data=data)
        return True

    def save(self, step: int, *, data: Optional[Mapping[str, Any]] = None) -> str:
        """Saves this rank's checkpoint of ``step`` now (e.g. at the end of training) and returns
        its path; rank 0 then deletes checkpoints beyond the newest ``keep`` complete ones."""
        import torch

        if not isinstance(step, int) or step < 0:
            raise terse.InvalidArgument(f"terse.checkpoint: step must be a whole number >= 0, "
                                        f"not {step!r}")
        peers = self._peers()
        payload = {"step": step,
                   "state": {name: obj.state_dict() for name, obj in self._objects.items()},
                   "data": dict(data or {}),
                   "random": _random_streams() if self.random_streams else None}
        settings = self._terse_settings()
        header = {"format": FORMAT_VERSION, "rank": peers.rank, "world_size": peers.size,
                  "step": step, "objects": sorted(self._objects), "terse": settings,
                  "fingerprint": _fingerprint(settings),
                  "saved_by": {"terse": terse.__version__, "torch": torch.__version__},
                  "payload_bytes": _PLACEHOLDER_BYTES, "payload_sha256": _PLACEHOLDER_SHA}
        space = len(json.dumps(header).encode())
        folder = _step_directory(self.directory, step)
        new_folder = not os.path.isdir(folder)
        os.makedirs(folder, exist_ok=True)
        if new_folder:
            _fsync_directory(self.directory)
        path = _rank_file(self.directory, step, peers.rank)
        temporary = os.path.join(folder, f".rank-{peers.rank:05d}.ckpt.tmp-{os.getpid()}")
        try:
            with open(temporary, "wb") as f:
                f.write(MAGIC + struct.pack("<I", space) + b" " * space)
                writer = _HashingWriter(f)
                torch.save(payload, writer)
                header.update(payload_bytes=writer.bytes, payload_sha256=writer.sha.hexdigest())
                text = json.dumps(header).encode()
                f.seek(len(MAGIC) + 4)
                f.write(text + b" " * (space - len(text)))
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        except BaseException:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise
        _fsync_directory(folder)
        self.saved = step
        if peers.rank == 0:
            self._prune(peers.size)
        return path

    def _prune(self, size: int) -> None:
        """Keeps the newest ``keep`` complete checkpoints and what is newer (checkpoints being
        written); deletes the rest. Each rank writes its steps in order, so a folder older than
        a complete checkpoint that is still incomplete will never be completed."""
        listing = self._listing()
        kept = self._complete(listing, size)[:self.keep]
        if not kept:
            return
        for step in listing:
            if step < kept[-1]:
                self._delete(step)

    # ---- resuming --------------------------------------------------------------------------

    def resume(self) -> Resumed:
        """Finds the newest checkpoint every rank completed, checks this rank's file of it and
        loads it into the objects (and the random streams); returns ``(step, data)``, or
        ``(0, {})`` when there is none. A collective under torch.distributed: the ranks agree on
        the step, and a file refused on any rank raises on every rank. Checkpoints newer than
        the one loaded are incomplete; rank 0 deletes them, so that no rank's file of this run
        can join another's of an earlier one. Raises DecodeError for a damaged file and
        MismatchError for a foreign one (another rank's, world size, objects, codec or policy),
        naming the file and what differs; InvalidArgument if the ranks see different
        checkpoints (a directory they do not share)."""
        peers = self._peers()
        listing = self._listing()
        complete = self._complete(listing, peers.size)
        views = peers.gather(complete)
        if views is not None and any(v != complete for v in views):
            seen = "; ".join(f"rank {r}: {v[:3]}" for r, v in enumerate(views))
            raise terse.InvalidArgument(
                f"terse.checkpoint: the ranks see different complete checkpoints in "
                f"{self.directory} ({seen}): every rank must see the same directory (one "
                "machine, or a filesystem they share)")
        chosen = complete[0] if complete else None
        failure: Optional[BaseException] = None
        data: Dict[str, Any] = {}
        try:
            if peers.rank == 0:
                self._check_newer(listing, chosen, peers)
            if chosen is not None:
                data = self._load(listing[chosen][peers.rank], chosen, peers)
        except Exception as e:  # raised after every rank has said how it fared
            failure = e
        statuses = peers.gather(None if failure is None else
                                (type(failure).__name__, str(failure)))
        if failure is not None:
            raise failure
        for r, status in enumerate(statuses or ()):
            if status is not None:
                kind = getattr(terse, status[0], None)
                if not (isinstance(kind, type) and issubclass(kind, terse.Error)):
                    kind = terse.Error
                raise kind(f"rank {r} could not resume: {status[1]}")
        if peers.rank == 0:
            for step in listing:
                if chosen is None or step > chosen:
                    self._delete(step)
        peers.barrier()
        self.resumed_from = chosen
        self.saved = chosen
        return Resumed(0 if chosen is None else chosen, data)

    def _check_newer(self, listing: Mapping[int, Mapping[int, str]], chosen: Optional[int],
                     peers: _Peers) -> None:
        """Refuses to go on (and so to delete) when a folder newer than ``chosen`` holds a
        checkpoint of another job: another world size, objects, codec or policy (the header of
        its lowest rank's file; unreadable ones are remains of this job and are deleted)."""
        for step in sorted(listing, reverse=True):
            if chosen is not None and step <= chosen or not listing[step]:
                continue
            path = listing[step][min(listing[step])]
            try:
                header = read_header(path)
            except terse.DecodeError:
                continue
            self._check_header(path, header, peers, step=step, own=False)

    def _load(self, path: str, step: int, peers: _Peers) -> Dict[str, Any]:
        """Checks this rank's file of ``step`` and loads it; returns its data position."""
        import torch

        header = read_header(path)
        self._check_header(path, header, peers, step=step, own=True)
        verify(path, header)
        with open(path, "rb") as f:
            payload = torch.load(_Slice(f, header["offset"], int(header["payload_bytes"])),
                                 **_load_kwargs())
        if not isinstance(payload, dict) or payload.get("step") != step:
            raise _damaged(path, "its payload is not this step's checkpoint")
        state = payload["state"]
        for name, obj in self._objects.items():
            try:
                obj.load_state_dict(state[name])
            except terse.Error as e:
                raise type(e)(f"terse.checkpoint: {path}: {name}: {e}") from e
            except (RuntimeError, KeyError, ValueError) as e:  # torch's: other keys or shapes
                raise terse.MismatchError(f"terse.checkpoint: {path}: {name} does not take the "
                                          f"saved state: {e}") from e
        if self.random_streams and payload.get("random") is not None:
            _restore_random_streams(payload["random"])
        return dict(payload["data"])
