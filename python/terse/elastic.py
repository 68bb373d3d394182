"""Live recovery: training that goes on when a worker dies or stalls, without restarting the
survivors, and takes a restarted or new worker back in at a step boundary.

Run the job under ``terse run --elastic --max-restarts K -n N -- python train.py``: the
launcher serves the job's store (it outlives every worker) and starts a worker that died again;
the survivors never restart. In the script::

    job = terse.elastic.ElasticDDP(model, optimizer, codec="minmax8:ef=1")
    while job.step < total_steps:
        x, y = job.split(*global_batch(job.step))   # this member's share of the step's batch
        loss = loss_fn(job.model(x), y)
        loss.backward()
        job.commit()                                  # the step, on every member alike

How it works:

* **Members and generations.** The workers alive at a moment are the members of a
  *generation*; each generation has its own terse communicator (its keys under its own prefix
  in the store, so nothing of an older generation reaches a newer one). Ranks are the members'
  launcher slots in order (slot = the launcher's ``RANK``), so a member's rank may change when
  another leaves or joins.
* **A failure.** A peer that dies or stalls fails every member's collectives within the
  timeout (at once for a death). The hook leaves the gradients as they are, and ``commit()``
  drops the step on every member: nothing is applied, the step is retried by the next
  generation with the same global batch. Then the survivors re-form: each arrives at the next
  generation; the first to arrive closes it once every member of the last generation has
  arrived or is known dead (the launcher records deaths in the store), or ``settle`` seconds
  after it arrived (a stalled member is then left out). A member that arrives after the close
  joins the generation after.
* **A join.** A restarted worker (or one left out) arrives at the next generation and waits;
  the members see it at their next ``commit()`` (one store read per step), finish that step,
  and re-form with it.
* **State.** After re-forming, the member that has applied the most steps (the lowest rank
  among equals) sends the model's and optimizer's state and the step count to every member
  behind it (a joiner, or a survivor that missed the last commit); every member then checks that
  its parameters hash alike. What the engine held (error-feedback residuals, PowerSGD's Q,
  the planner's state) is reset on every member at each re-forming: a dead worker's residuals
  are lost with it, and the others start their codec state afresh, alike.
* **The step's commit.** ``commit()`` exchanges one vote per member (its hook succeeded, it
  saw a joiner); the optimizer steps on a member only when the vote completed and every member
  succeeded. A member whose vote failed while another's completed ends one step behind; the
  state transfer above brings it level, so no step is applied twice or lost.
* **Data.** Every step has one global batch (the same whatever the world size: make it a
  function of the step); ``split`` gives this member its rank's share (``torch.tensor_split``
  along dimension 0). The gradient is averaged over the members, so with a global batch that
  the world sizes divide evenly (e.g. 12 samples for 3 or 4 workers) a step computes the same
  mean gradient at any world size.

Limits: DDP runs over a one-process group and the terse hook carries every gradient (as
torchft does), so DDP's buffer broadcast reaches no one: buffers (BatchNorm's statistics) stay
per worker between re-formings, which send them with the model. The launcher's store is a
single point of failure.

DiLoCo is elastic too: :class:`ElasticDiLoCo` (DiLoCo's knobs and loop; a failed outer step is
retried by the survivors with their local progress; a joiner is taken in at an outer step).
Streaming DiLoCo (fragments, delay) is not.

So is DDP through terse's torch.distributed backend (:mod:`terse.backend`):
:class:`ElasticBackendDDP` wraps the module in plain DDP (no comm hook) over a terse backend
process group made for each generation (:func:`terse.backend.process_group`, over the
generation's own store prefix, rank and size; the backend's policy from
:func:`terse.backend.configure` or the environment). A peer's failure fails the backend's
allreduce in DDP's reducer, and torch raises it from ``loss.backward()``; the loop calls
``job.backward(loss)``, which absorbs it (and ``job.model``'s forward absorbs one in DDP's
collectives there), so that ``commit()`` drops the step on every member and all re-form, each
with a fresh DDP over the new generation's group::

    job = terse.elastic.ElasticBackendDDP(model, optimizer)
    while job.step < total_steps:
        x, y = job.split(*global_batch(job.step))
        job.backward(loss_fn(job.model(x), y))
        job.commit()

It needs torch >= 2.6 (the backend's extension); with torch 1.13 it raises ImportError.
"""

from __future__ import annotations

import gc
import hashlib
import io
import json
import os
import re
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import terse
import terse.diloco as terse_diloco
import terse.torch as terse_torch

__all__ = ["Membership", "Generation", "ElasticDDP", "ElasticBackendDDP", "ElasticDiLoCo"]

_PREFIX = "terse-elastic"


class Generation:
    """One generation: its number, the members (launcher slots) in rank order, this worker's
    rank, each member's applied step (-1: a joiner that holds no state) and the communicator."""

    def __init__(self, number: int, members: List[Dict[str, int]], rank: int,
                 communicator: terse.Communicator) -> None:
        self.number = number
        self.members = members
        self.rank = rank
        self.size = len(members)
        self.communicator = communicator

    def __repr__(self) -> str:
        slots = ",".join(str(m["slot"]) for m in self.members)
        return f"generation {self.number} (slots {slots}; this is rank {self.rank})"


class Membership:
    """Agreement on who is a member, through the job's store (``Store.add`` counters and
    set-once keys; no leader). ``slot``: this worker's launcher slot (``RANK``), ``slots`` the
    job's (``WORLD_SIZE``), ``incarnation`` how often the launcher restarted this slot
    (``TERSE_RESTART_COUNT``)."""

    def __init__(self, store: terse.Store, slot: int, slots: int, incarnation: int = 0, *,
                 timeout: float = 60.0, settle: float = 1.5,
                 join_timeout: Optional[float] = None) -> None:
        if settle <= 0 or timeout <= 0 or (join_timeout is not None and join_timeout <= 0):
            raise terse.InvalidArgument("Membership: settle and the timeouts must be > 0")
        # How long a worker waits to be taken in: the others' start-up, or their next commit.
        self.join_timeout = join_timeout if join_timeout is not None else max(120.0, timeout)
        self.store = store
        self.slot = slot
        self.slots = slots
        self.incarnation = incarnation
        self.timeout = timeout
        self.settle = settle
        self.generation: Optional[Generation] = None

    @classmethod
    def from_env(cls, *, timeout: Optional[float] = None, settle: float = 1.5,
                 join_timeout: Optional[float] = None) -> "Membership":
        """From the launcher's environment (``terse run --elastic``): RANK, WORLD_SIZE,
        TERSE_RESTART_COUNT and the store it serves."""
        if os.environ.get("TERSE_STORE_SERVED") != "1":
            raise terse.InvalidArgument(
                "terse.elastic needs a store that outlives every worker: run the job under "
                "`terse run --elastic` (TERSE_STORE_SERVED=1), or make a Membership over such a "
                "store yourself")
        if timeout is None:
            timeout = float(os.environ.get("TERSE_TIMEOUT") or 60)
        slot, slots, store = terse.bootstrap_from_env(timeout=timeout)
        return cls(store, slot, slots, int(os.environ.get("TERSE_RESTART_COUNT") or 0),
                   timeout=timeout, settle=settle, join_timeout=join_timeout)

    # ---- the store's keys --------------------------------------------------------------------

    def _count(self, key: str, delta: int = 0) -> int:
        return int(self.store.add(f"{_PREFIX}/{key}", delta))

    def _get(self, key: str, timeout: float) -> Any:
        return json.loads(self.store.get(f"{_PREFIX}/{key}", timeout=timeout))

    def _set(self, key: str, value: Any) -> None:
        self.store.set(f"{_PREFIX}/{key}", json.dumps(value).encode())

    def latest(self) -> int:
        """The newest closed generation (0 before the first)."""
        return self._count("latest")

    def waiting(self) -> bool:
        """Whether a worker waits to join the generation after this one (one store read)."""
        g = self.generation.number if self.generation else self.latest()
        return self._count(f"g{g + 1}/arrivals") > 0

    def finish(self) -> None:
        """Marks the job finished: a worker that arrives from now on exits (status 0)."""
        self._count("finished", 1)

    def _check_finished(self) -> None:
        if self._count("finished") > 0:
            print(f"terse.elastic: slot {self.slot}: the job finished before this worker was "
                  "taken in; nothing left to do", flush=True)
            raise SystemExit(0)

    def _dead(self, slot: int, incarnation: int) -> bool:
        return self._count(f"dead/{slot}/{incarnation}") > 0

    # ---- re-forming --------------------------------------------------------------------------

    def join(self, step: int) -> Generation:
        """Arrives at the next generation with ``step`` (the steps this worker has applied; -1
        for none) and returns it once closed with this worker in it, with its communicator
        connected. A worker that arrives after the close tries the one after. Bounded by the
        join timeout; raises TimeoutError naming the generation otherwise."""
        deadline = time.monotonic() + self.join_timeout
        number = (self.generation.number if self.generation else self.latest()) + 1
        while True:
            self._check_finished()
            if self._count("failed") > 0:
                raise terse.TransportError(f"slot {self.slot}: {self._get('failed', 1)}")
            generation = self._arrive(number, step, deadline)
            if generation is not None:
                self.generation = generation
                return generation
            number = max(number, self.latest()) + 1
            if time.monotonic() > deadline:
                raise terse.TimeoutError(
                    f"slot {self.slot}: no generation took this worker in within "
                    f"{self.join_timeout:.0f} s (last tried: generation {number - 1})")

    def _arrive(self, number: int, step: int, deadline: float) -> Optional[Generation]:
        me = {"slot": self.slot, "incarnation": self.incarnation, "step": step}
        index = self._count(f"g{number}/arrivals", 1)
        self._set(f"g{number}/arrival/{index}", me)
        if self._count(f"g{number}/closer", 1) == 1:
            self._close(number, deadline)
        left = max(0.1, deadline - time.monotonic())
        try:
            chosen = self._get(f"g{number}/members", timeout=left)
        except terse.TimeoutError:
            # Its closer died before deciding: on to the next generation.
            return None
        members = [self._get(f"g{number}/arrival/{i}", timeout=left) for i in chosen]
        if index not in chosen:
            if any(m["slot"] == self.slot and m["incarnation"] > self.incarnation
                   for m in members):
                raise terse.InvalidArgument(
                    f"slot {self.slot}: a newer incarnation of this worker is a member of "
                    f"generation {number}; this one ({self.incarnation}) stops")
            return None
        members.sort(key=lambda m: m["slot"])
        rank = [m["slot"] for m in members].index(self.slot)
        try:
            comm = terse.Communicator(rank, len(members), self.store, timeout=self.timeout,
                                      prefix=f"{_PREFIX}/g{number}/comm")
        except (terse.TransportError, terse.TimeoutError):
            # A member died before connecting: every member fails alike, and tries the next.
            return None
        return Generation(number, members, rank, comm)

    def _close(self, number: int, deadline: float) -> None:
        """Run by the generation's first arrival: decides its members."""
        # The members of the newest closed generation (one whose closer died stays unclosed).
        previous: Optional[List[Dict[str, int]]] = None
        latest = self.latest()
        if latest > 0:
            previous = self._get(f"g{latest}/members-info", timeout=self.timeout)
        # The settle window opens when the first member of the last generation arrives: joiners
        # alone wait for the members' next commit (up to the timeout).
        settle_at: Optional[float] = None
        arrivals: Dict[int, Dict[str, int]] = {}
        while True:
            count = self._count(f"g{number}/arrivals")
            for i in range(len(arrivals) + 1, count + 1):
                arrivals[i] = self._get(f"g{number}/arrival/{i}", timeout=self.timeout)
            here = {(a["slot"], a["incarnation"]) for a in arrivals.values()}
            if previous is None:
                if len({a["slot"] for a in arrivals.values()}) >= self.slots:
                    break
            else:
                old = [(m["slot"], m["incarnation"]) for m in previous]
                if settle_at is None and any(m in here for m in old):
                    settle_at = time.monotonic() + self.settle
                if all(m in here or self._dead(*m)
                       for m in old):
                    if any(m in here for m in old):
                        break
                    # Every member of the last generation is dead: the joiners hold no state,
                    # and the job is over (every worker learns it at its next join).
                    self._set("failed", f"every member of generation {latest} died; no worker "
                              "holds the model's state to continue from (restart the job)")
                    self._count("failed", 1)
                    raise terse.TransportError(f"slot {self.slot}: {self._get('failed', 1)}")
                if settle_at is not None and time.monotonic() > settle_at:
                    break
                self._check_finished()
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        # One member per slot: its newest incarnation.
        best: Dict[int, int] = {}
        for i, a in sorted(arrivals.items()):
            j = best.get(a["slot"])
            if j is None or a["incarnation"] > arrivals[j]["incarnation"]:
                best[a["slot"]] = i
        chosen = sorted(best.values(), key=lambda i: arrivals[i]["slot"])
        self._set(f"g{number}/members-info",
                  [{"slot": arrivals[i]["slot"], "incarnation": arrivals[i]["incarnation"]}
                   for i in chosen])
        self._set(f"g{number}/members", chosen)
        self._count("latest", number - self.latest())


def _digest(tensors: List[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """An optimizer's state tensors (momentum buffers, ...) in a fixed order, to hash."""
    state = optimizer.state_dict()["state"]
    return [v for k in sorted(state) for _, v in sorted(state[k].items())
            if isinstance(v, torch.Tensor)]


class _Recovery:
    """What the elastic front ends share: the membership, re-forming (join the next generation,
    bring every member to the state of the one furthest ahead, check that the state hashes
    alike), the per-step vote and the record of re-formings. A front end provides
    ``_progress`` (what it has applied: steps, outer steps), ``_state`` / ``_load_state`` (what
    a member behind receives), ``_reconnect`` (its engine over a new communicator; a
    collective) and ``_digest`` (what must be alike on every member)."""

    membership: Membership
    extra: Any
    events: List[Dict[str, Any]]

    def _start_recovery(self, membership: Optional[Membership], timeout: Optional[float],
                        settle: float, join_timeout: Optional[float], extra: Any,
                        log: Optional[Callable[[str], None]]) -> None:
        self.membership = membership or Membership.from_env(timeout=timeout, settle=settle,
                                                            join_timeout=join_timeout)
        self.extra = extra
        self.events = []
        self._log = log or (lambda text: None)

    # ---- what a front end provides -----------------------------------------------------------

    def _progress(self) -> int:
        raise NotImplementedError

    def _state(self) -> Dict[str, Any]:
        raise NotImplementedError

    def _load_state(self, state: Dict[str, Any], joiner: bool) -> None:
        raise NotImplementedError

    def _reconnect(self, comm: terse.Communicator) -> None:
        raise NotImplementedError

    def _digest(self) -> str:
        raise NotImplementedError

    def _release(self) -> None:
        """Releases what the front end holds over the last generation (its engine, its group)."""
        raise NotImplementedError

    # ---- shared ------------------------------------------------------------------------------

    @property
    def generation(self) -> Generation:
        return self.membership.generation

    @property
    def rank(self) -> int:
        """This worker's rank among the current generation's members."""
        return self.generation.rank

    @property
    def size(self) -> int:
        """The number of members of the current generation."""
        return self.generation.size

    def split(self, *tensors: torch.Tensor) -> Any:
        """This member's share (its rank's of ``size`` nearly equal parts, along dimension 0)
        of each of the step's global tensors."""
        parts = [torch.tensor_split(t, self.size)[self.rank] for t in tensors]
        return parts[0] if len(parts) == 1 else tuple(parts)

    def close(self) -> None:
        """Ends this worker's part once training is over: marks the job finished (a worker
        that arrives later exits at once), waits for the members, releases the engine."""
        try:
            self.membership.finish()
            self.generation.communicator.barrier("terse.elastic close")
        finally:
            self._release()

    def _vote(self, mine: List[Any], label: str) -> Optional[List[List[Any]]]:
        """Every member's ``mine`` followed by whether it saw a worker waiting to join, in rank
        order; None when the vote failed (a peer died or stalled)."""
        mine = list(mine) + [self.membership.waiting()]
        try:
            return [json.loads(v) for v in self.generation.communicator.allgather_bytes(
                json.dumps(mine).encode(), label=label)]
        except (terse.TransportError, terse.TimeoutError) as e:
            self._log(f"{label} failed: {e}")
            return None

    def _reform(self, why: str, progress: int) -> None:
        began = time.monotonic()
        while True:
            generation = self.membership.join(progress)
            try:
                sent = self._synchronize(generation)
                break
            except (terse.TransportError, terse.TimeoutError) as e:
                # A member failed while the generation formed: on to the next one.
                self._log(f"{generation}: failed while forming: {e}")
                progress = self._progress()
        seconds = time.monotonic() - began
        event = {"why": why, "generation": generation.number, "step": self._progress(),
                 "slots": [m["slot"] for m in generation.members], "seconds": seconds,
                 "state_bytes": sent, "at": time.time()}
        self.events.append(event)
        self._log(f"{generation} formed after a {why} in {seconds:.2f} s at step "
                  f"{self._progress()}" + (f"; {sent} bytes of state sent" if sent else ""))

    def _state_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save({**self._state(),
                    "extra": None if self.extra is None else self.extra.state_dict()}, buffer)
        return buffer.getvalue()

    def _synchronize(self, generation: Generation) -> int:
        """Makes the front end's engine over the new communicator, brings every member to the
        state of the one furthest ahead, then checks that the state hashes alike. Returns the
        bytes this worker sent or received."""
        comm = generation.communicator
        steps = [m["step"] for m in generation.members]
        me = generation.members[generation.rank]
        if me["step"] != self._progress() and me["step"] != -1:
            raise terse.InvalidArgument(f"slot {me['slot']}: arrived with step {me['step']}, "
                                        f"holds {self._progress()}")
        if max(steps) < 0:
            raise terse.InvalidArgument(f"{generation}: no member holds the model's state")
        source = steps.index(max(steps))
        self._reconnect(comm)
        moved = 0
        if any(s != max(steps) for s in steps):
            data = comm.broadcast_bytes(
                source, self._state_bytes() if generation.rank == source else None,
                label=f"terse.elastic state of generation {generation.number}")
            moved = len(data)
            if generation.rank != source:
                state = torch.load(io.BytesIO(data), weights_only=False)
                self._load_state(state, joiner=me["step"] == -1)
                if self.extra is not None and state["extra"] is not None:
                    self.extra.load_state_dict(state["extra"])
        digest = self._digest()
        everyone = [d.decode() for d in comm.allgather_bytes(
            digest.encode(), label=f"terse.elastic check of generation {generation.number}")]
        if len(set(everyone)) != 1:
            raise terse.MismatchError(
                f"{generation}: the members' parameters or steps differ after re-forming: "
                f"{everyone}")
        return moved


class _DataParallel(_Recovery):
    """What the data-parallel front ends (:class:`ElasticDDP`, :class:`ElasticBackendDDP`)
    share: the state (model, optimizer, step count) and the end of a step after its vote."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int

    def _end_step(self, votes: Optional[List[List[Any]]]) -> bool:
        """Applies the step when the vote completed and every member succeeded, drops it
        otherwise; re-forms after a failure or when a worker waits to join."""
        applied = votes is not None and all(v[0] for v in votes)
        if applied:
            self.optimizer.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        if votes is None or not applied:
            self._reform("failure", self.step)
        elif any(v[-1] for v in votes):
            self._reform("join", self.step)
        return applied

    # ---- what _Recovery asks -----------------------------------------------------------------

    def _progress(self) -> int:
        return self.step

    def _state(self) -> Dict[str, Any]:
        return {"step": self.step, "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict()}

    def _load_state(self, state: Dict[str, Any], joiner: bool) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])

    def _digest(self) -> str:
        return _digest([p for p in self.module.parameters()]) + f":{self.step}"


class ElasticDDP(_DataParallel):
    """Data-parallel training with live recovery: DDP over this process alone with the terse
    hook carrying the gradients between the members of the current generation (see the
    module's docstring).

    ``module`` and ``optimizer`` are the user's; ``extra`` (optional) is an object with
    ``state_dict``/``load_state_dict`` sent to joiners with the model (e.g. an LR scheduler).
    The hook's knobs (``codec``, ``min_bytes``, ``strategy``, ... of
    :class:`terse.torch.TerseHookState`) are passed through; ``timeout`` bounds every wait and
    is how long a stalled worker holds the others up; ``settle`` how long the survivors wait for
    a member that neither arrived nor died; ``join_timeout`` how long a worker waits to be taken
    in (default: the larger of 120 s and ``timeout``). ``membership``: by default
    :meth:`Membership.from_env`. Attributes: ``model`` (the DDP model to call), ``step`` (steps
    applied), ``generation``, ``events`` (one dict per re-forming: why, when, the members,
    seconds taken, bytes of state sent).
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 extra: Any = None, membership: Optional[Membership] = None,
                 timeout: Optional[float] = None, settle: float = 1.5,
                 join_timeout: Optional[float] = None,
                 log: Optional[Callable[[str], None]] = None, **knobs: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        elif dist.get_world_size() != 1:
            raise terse.InvalidArgument(
                "terse.elastic.ElasticDDP runs DDP over this process alone (the terse hook "
                "carries the gradients); torch.distributed is initialized over "
                f"{dist.get_world_size()} processes, whose group would break with a worker")
        self._start_recovery(membership, timeout, settle, join_timeout, extra, log)
        self.module = module
        self.optimizer = optimizer
        self.step = 0
        self.state = terse_torch.TerseHookState(module, lazy=True,
                                                timeout=self.membership.timeout, **knobs)
        self.state._absorb_peer_failures = True
        self.model = DistributedDataParallel(module)
        self.model.register_comm_hook(self.state, terse_torch.hook)
        joining = self.membership.incarnation > 0
        self._reform("join" if joining else "start", -1 if joining else 0)

    # ---- what the training loop calls --------------------------------------------------------

    def commit(self) -> bool:
        """Ends the step after ``backward()``: applies it (``optimizer.step()``) on every member
        alike, or drops it on every member when a peer failed, then re-forms the members if one
        failed or a worker waits to join. Returns whether the step was applied. Errors other
        than a peer's failure (a NaN, a mismatch) are raised as they are."""
        error = self.state.error
        if error is not None and not self.state._peer_failure(error):
            raise error
        votes = self._vote([error is None], f"terse.elastic vote of step {self.step}")
        return self._end_step(votes)

    def _release(self) -> None:
        self.state.close()

    # ---- what _Recovery asks -----------------------------------------------------------------

    def _reconnect(self, comm: terse.Communicator) -> None:
        self.state._reconnect(comm)


# The text of terse's transport and timeout errors (terse.TransportError, terse.TimeoutError)
# as they reach Python through torch: an error that the terse backend's work raises in DDP's
# reducer or collectives comes out of loss.backward() or DDP's forward as a RuntimeError with
# the same text, without its type (src/transport/communicator.cpp words them).
_PEER_FAILURE = re.compile(
    r"closed the connection|communicator (?:has|had) failed|peer \d+ aborted|"
    r"timed out after \d+ ms|stalled, died|connecting to \d+ other ranks|"
    r"Connection reset|Connection refused|closed by peer|Read error|Write error|writev|"
    r"waiting for store key")


def _peer_failed(error: BaseException) -> bool:
    """Whether ``error`` is a dead or stalled peer's: a terse transport or timeout error, typed
    (terse's own calls) or as torch passes it on (a RuntimeError with its text)."""
    if isinstance(error, (terse.TransportError, terse.TimeoutError)):
        return True
    return isinstance(error, RuntimeError) and _PEER_FAILURE.search(str(error)) is not None


class _StoreView(dist.Store):
    """The job's terse store as a torch.distributed Store, every key under ``prefix``: what a
    terse backend group of one generation connects over."""

    def __init__(self, store: terse.Store, prefix: str, timeout: float) -> None:
        super().__init__()
        self._store = store
        self._prefix = prefix
        self._timeout = timeout

    def set(self, key: str, value: Any) -> None:
        self._store.set(self._prefix + key, value.encode() if isinstance(value, str)
                        else bytes(value))

    def get(self, key: str) -> bytes:
        return self._store.get(self._prefix + key, timeout=self._timeout)

    def add(self, key: str, value: int) -> int:
        return int(self._store.add(self._prefix + key, value))

    def wait(self, keys: List[str], timeout: Any = None) -> None:
        seconds = self._timeout if timeout is None else timeout.total_seconds()
        self._store.wait([self._prefix + k for k in keys], timeout=seconds)


class _ElasticDistributedDataParallel(DistributedDataParallel):
    """DDP whose forward absorbs a peer's failure in DDP's own collectives there (the bucket
    rebuild's broadcast at its second step, the buffers' broadcast): the step is then dropped,
    and this forward runs on the local module so that the training loop goes on to commit()."""

    _terse_job: Any = None  # a weak reference to the ElasticBackendDDP

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        job = self._terse_job() if self._terse_job is not None else None
        if job is not None and job._failure is None:
            try:
                return super().forward(*inputs, **kwargs)
            except RuntimeError as e:
                if not _peer_failed(e):
                    raise
                job._absorb(e, "forward")
        return self.module(*inputs, **kwargs)


class ElasticBackendDDP(_DataParallel):
    """Data-parallel training with live recovery through terse's torch.distributed backend:
    plain ``DistributedDataParallel`` (no comm hook) over a terse backend process group
    (:mod:`terse.backend`) of the current generation's members. The guarantees are
    :class:`ElasticDDP`'s; the difference is the door the gradients take::

        job = terse.elastic.ElasticBackendDDP(model, optimizer)
        while job.step < total_steps:
            x, y = job.split(*global_batch(job.step))
            job.backward(loss_fn(job.model(x), y))   # not loss.backward(): see below
            job.commit()
        job.close()

    * **The group.** Each generation gets its own terse backend group
      (:func:`terse.backend.process_group`), connected over the job's store under the
      generation's own prefix with the generation's rank and size, and the module is wrapped
      in a fresh DDP over it once the members' state is synchronized (so DDP's initial
      broadcast moves the same values). The old DDP and group are released first. What is
      compressed is terse.backend's policy (:func:`terse.backend.configure` or the
      ``TERSE_BACKEND_*`` environment, read when each group is made); every member checks at
      each re-forming that the others' is the same (MismatchError naming the setting).
      ``job.model`` is the current DDP (read it each step); ``job.process_group`` its group.
    * **A failure.** A peer that dies or stalls fails the backend's allreduce in DDP's reducer;
      torch raises it from ``loss.backward()`` as a RuntimeError carrying terse's text.
      :meth:`backward` absorbs it when that text is a terse transport or timeout error's (any
      other error is raised as it is), as ``job.model``'s forward does for DDP's collectives
      there. :meth:`commit` then drops the step: this member aborts the generation's
      communicator instead of voting, so that every other member's vote fails at once (no
      member applies a step without every member's vote), and all re-form. DDP's reducer,
      left mid-step by the error, goes with its generation. A step whose backward succeeded
      everywhere takes :class:`ElasticDDP`'s vote.
    * **Joins, state, codec state, data**: as :class:`ElasticDDP` (the backend's engine, with
      any error-feedback state, is made anew with each generation's group, alike everywhere).

    ``ddp_options`` go to ``DistributedDataParallel`` (``bucket_cap_mb``,
    ``broadcast_buffers``, ``find_unused_parameters``, ...), except ``process_group`` and
    ``device_mesh``. The other arguments are :class:`ElasticDDP`'s; each group's waits are
    bounded by ``timeout`` unless ``TERSE_TIMEOUT`` is set (terse.backend's rule; ``terse run
    --timeout`` sets it for both). Needs torch >= 2.6 (the backend's); CPU tensors (the
    backend's).
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 extra: Any = None, membership: Optional[Membership] = None,
                 timeout: Optional[float] = None, settle: float = 1.5,
                 join_timeout: Optional[float] = None,
                 log: Optional[Callable[[str], None]] = None,
                 ddp_options: Optional[Dict[str, Any]] = None) -> None:
        import terse.backend  # ImportError with torch < 2.6, saying so

        self._backend = terse.backend
        self.ddp_options = dict(ddp_options or {})
        for key in ("process_group", "device_mesh"):
            if key in self.ddp_options:
                raise terse.InvalidArgument(
                    f"terse.elastic.ElasticBackendDDP: ddp_options may not set {key}: each "
                    "generation's DDP runs over that generation's terse backend group")
        self._start_recovery(membership, timeout, settle, join_timeout, extra, log)
        self.module = module
        self.optimizer = optimizer
        self.step = 0
        self._failure: Optional[str] = None
        self._model: Optional[DistributedDataParallel] = None
        self._group: Optional[dist.ProcessGroup] = None
        joining = self.membership.incarnation > 0
        self._reform("join" if joining else "start", -1 if joining else 0)

    @property
    def model(self) -> DistributedDataParallel:
        """The DDP of the current generation (a new one after each re-forming)."""
        assert self._model is not None
        return self._model

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The terse backend group of the current generation."""
        assert self._group is not None
        return self._group

    # ---- what the training loop calls --------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)``, DDP's gradient allreduce through the terse backend
        included; a peer's failure there is absorbed (the step is then dropped at commit()).
        Skipped once the step has failed."""
        if self._failure is not None:
            return
        try:
            loss.backward(**kwargs)
        except RuntimeError as e:
            if not _peer_failed(e):
                raise
            self._absorb(e, "backward")

    def commit(self) -> bool:
        """Ends the step after :meth:`backward`: applies it on every member alike, or drops it
        on every member when a peer failed, then re-forms the members if one failed or a worker
        waits to join. Returns whether the step was applied."""
        failure, self._failure = self._failure, None
        if failure is None:
            votes = self._vote([True], f"terse.elastic vote of step {self.step}")
        else:
            # No vote: without this member's, no member's vote completes, so none applies the
            # step; aborting makes the others' votes fail now rather than at their timeout.
            votes = None
            try:
                self.generation.communicator.abort(
                    f"terse.elastic: step {self.step} failed on slot {self.membership.slot}: "
                    f"{failure}")
            except terse.Error:
                pass  # failed already: the others' votes fail all the same
        return self._end_step(votes)

    # ---- the generation's group and DDP ------------------------------------------------------

    def _absorb(self, error: BaseException, where: str) -> None:
        text = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        self._failure = f"a peer failed during the {where}: {text}"
        self._log(f"step {self.step}: {self._failure}")

    def _release(self) -> None:
        """Drops the last generation's DDP and group (the group's engine closes with it). The
        DDP's reducer goes with it, and with the reducer its hooks on the parameters."""
        model, self._model, self._group = self._model, None, None
        if model is None:
            return
        model._terse_job = None
        gone = weakref.ref(model)
        del model
        if gone() is not None:
            gc.collect()  # held by a cycle (a traceback's frames): free it now, not later

    def _settings(self) -> Dict[str, Any]:
        policy = self._backend.policy_from_settings()
        return {"codec": policy.codec, "all_gather_codec": policy.all_gather_codec,
                "all_to_all_codec": policy.all_to_all_codec, "min_bytes": policy.min_bytes,
                "ddp_options": sorted((k, repr(v)) for k, v in self.ddp_options.items())}

    def _reconnect(self, comm: terse.Communicator) -> None:
        self._release()
        self._failure = None
        generation = self.generation
        mine = self._settings()
        label = f"terse.elastic settings of generation {generation.number}"
        for theirs in (json.loads(v) for v in comm.allgather_bytes(json.dumps(mine).encode(),
                                                                   label=label)):
            for key in mine:
                if json.loads(json.dumps(mine[key])) != theirs.get(key):
                    raise terse.MismatchError(
                        f"terse.elastic.ElasticBackendDDP: {generation}: the members' {key} "
                        f"differ ({mine[key]!r} here, {theirs.get(key)!r} on another); every "
                        "member must configure terse.backend and DDP alike")
        store = _StoreView(self.membership.store, f"{_PREFIX}/g{generation.number}/backend/",
                           self.membership.timeout)
        try:
            self._group = self._backend.process_group(store, generation.rank, generation.size,
                                                      self.membership.timeout)
        except RuntimeError as e:
            if not _peer_failed(e):
                raise
            raise terse.TransportError(f"{generation}: the backend group: {e}") from e

    def _synchronize(self, generation: Generation) -> int:
        moved = super()._synchronize(generation)
        # The state is alike on every member now: DDP's broadcast from rank 0 changes nothing.
        try:
            model = _ElasticDistributedDataParallel(self.module, process_group=self._group,
                                                    **self.ddp_options)
        except RuntimeError as e:
            if not _peer_failed(e):
                raise
            raise terse.TransportError(f"{generation}: DDP over the backend group: {e}") from e
        model._terse_job = weakref.ref(self)
        self._model = model
        return moved


class ElasticDiLoCo(_Recovery, terse_diloco.DiLoCo):
    """DiLoCo (:class:`terse.diloco.DiLoCo`: H inner steps on each worker, then the
    pseudo-gradient averaged through terse's collectives and an outer Nesterov step) with live
    recovery: a worker that dies or stalls is left out and the others go on, without
    restarting; a restarted worker is taken in at an outer step. Use it as DiLoCo::

        job = terse.elastic.ElasticDiLoCo(model, inner, sync_every=50, codec="minmax8:ef=1")
        while job.steps < total_steps:
            x, y = job.split(*global_batch(job.steps))  # this member's share of the step's
            job.zero_grad()
            loss_fn(model(x), y).backward()
            job.step()          # the inner step; every H steps the outer one, on every member
        job.finish()            # the last outer step; the model now holds the global parameters
        job.close()

    The knobs are DiLoCo's (``sync_every``, ``outer_optimizer``, ``mixing``, ``codec``,
    ``min_bytes``, ``strategy``, ``partitions``, ``auto_codecs``, ``heavy_codecs``,
    ``threads``: the same :class:`terse.Policy`) and ElasticDDP's (``extra``, ``membership``,
    ``timeout``, ``settle``, ``join_timeout``, ``log``). Streaming DiLoCo is not elastic:
    ``fragments`` must be 1 and ``delay`` 0.

    * **Inner steps** need no communication. The outer step at every H-th inner step is one
      exchange of the pseudo-gradient, then a vote (one small allgather, and one store read to
      see a worker waiting to join).
    * **A failure during an outer step** (a peer died or stalled: the exchange or the vote
      fails) drops it on every member: nothing is applied. The survivors re-form (a new
      generation and communicator) and retry it at once, keeping their local progress: each
      sends its own pseudo-gradient again (its H inner steps are not redone), and the average
      is over the survivors. A failure between two outer steps is noticed at the next one.
    * **The average** is over the members that trained since the last outer step: a member that
      received the state at a re-forming holds the global parameters (a pseudo-gradient of zero)
      and is not counted (the exchange's mean is scaled by members / contributors, on every
      member alike). Without faults every outer step is DiLoCo's.
    * **A join** happens at an outer step: the members see the waiting worker in that step's
      vote, apply it, and re-form with it; it receives the global parameters, the outer
      optimizer's state, the sender's inner optimizer state, the model's buffers, the counters
      (``steps``, ``outer_steps``) and ``extra``, sets its model to the global parameters and
      trains the next H inner steps in lock step. A worker may thus wait up to H inner steps to
      be taken in (``join_timeout`` must cover that).
    * **After every re-forming** the member that applied the most outer steps sends that state
      to every member behind it (a joiner, one left out by a stall, one whose vote alone
      failed); then every member checks that the global parameters, the outer optimizer's state
      and the counters hash alike (MismatchError otherwise), and that every member constructed
      it alike (MismatchError naming the setting).
    * **Codec state** (error-feedback residuals, PowerSGD's Q, the planner's) lives in the
      engine, made anew over each generation on every member alike: it restarts from zero at
      each re-forming.
    * **Data**: make each inner step's global batch a function of ``steps``; :meth:`split` gives
      this member its rank's share among the current members.
    """

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, *,
                 sync_every: int,
                 outer_optimizer: Optional[Callable[[List[torch.Tensor]],
                                                    torch.optim.Optimizer]] = None,
                 mixing: float = 0.0, codec: str = "none", min_bytes: int = 0,
                 strategy: str = "auto", partitions: int = 0,
                 auto_codecs: Optional[Sequence[str]] = None,
                 heavy_codecs: Optional[Sequence[str]] = None, threads: int = 0,
                 fragments: Any = 1, delay: int = 0,
                 extra: Any = None, membership: Optional[Membership] = None,
                 timeout: Optional[float] = None, settle: float = 1.5,
                 join_timeout: Optional[float] = None,
                 log: Optional[Callable[[str], None]] = None) -> None:
        if fragments != 1 or delay != 0:
            raise terse.InvalidArgument(
                "terse.elastic.ElasticDiLoCo: Streaming DiLoCo is not elastic: fragments must "
                f"be 1 and delay 0 (not {fragments!r} and {delay!r}); use terse.diloco.DiLoCo "
                "without live recovery")
        self._recovery_args = (membership, timeout, settle, join_timeout, extra, log)
        self._trained = False  # inner steps since the last outer step (or state received)
        self._final = False  # within finish()
        terse_diloco.DiLoCo.__init__(
            self, model, inner, sync_every=sync_every, outer_optimizer=outer_optimizer,
            mixing=mixing, codec=codec, min_bytes=min_bytes, strategy=strategy,
            partitions=partitions, auto_codecs=auto_codecs, heavy_codecs=heavy_codecs,
            threads=threads)

    def _open(self, communicator: Any, process_group: Any, timeout: Optional[float]) -> None:
        # Called by DiLoCo's constructor once the settings are checked: joins the members.
        self._start_recovery(*self._recovery_args)
        joining = self.membership.incarnation > 0
        self._reform("join" if joining else "start", -1 if joining else 0)
        self._outer()  # a joiner taken in while the survivors retry an outer step joins it

    # ---- what the training loop calls --------------------------------------------------------

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """The inner optimizer's step; at every H-th inner step also the outer one, applied on
        every member alike (retried after re-forming when a peer failed)."""
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self.steps += 1
        self._trained = True
        if self.steps % self.sync_every == 0:
            self._outer()
        return loss

    def finish(self) -> None:
        """Ends training on every member alike: one more outer step if any inner step came
        after the last one (merged without mixing). Afterwards every member's model holds the
        global parameters."""
        self._final = True
        try:
            self._outer()
        finally:
            self._final = False

    def _release(self) -> None:
        terse_diloco.DiLoCo.close(self)

    # ---- the outer step ----------------------------------------------------------------------

    def _due(self) -> int:
        """The outer steps due after the inner steps so far (in finish(): also a partial
        period's)."""
        return -(-self.steps // self.sync_every) if self._final else \
            self.steps // self.sync_every

    def _outer(self) -> None:
        """Runs the outer step due, until it is applied on every member (retrying it after each
        re-forming) or a member ahead sent this one its state."""
        f = self.fragments[0]
        while self.outer_steps < self._due():
            ok = self._exchange(f)
            votes = self._vote([ok, self._trained],
                               f"terse.elastic vote of outer step {self.outer_steps}")
            if votes is None or not all(v[0] for v in votes):
                self._reform("failure", self.outer_steps)
                continue
            contributors = sum(1 for v in votes if v[1])
            if contributors == 0:
                self.outer_steps += 1  # nobody trained since the last outer step: nothing moves
            else:
                if contributors < len(votes):
                    # The exchange's mean is over every member; those that hold the global
                    # parameters (they received the state since) sent zeros.
                    f.flat.mul_(len(votes) / contributors)
                self._apply(f, mixing=0.0 if self._final else None)
            self._trained = False
            self._log(f"outer step {self.outer_steps - 1} applied by generation "
                      f"{self.generation.number} ({self.size} members, {contributors} trained)")
            if any(v[-1] for v in votes):
                self._reform("join", self.outer_steps)

    def _exchange(self, f: Any) -> bool:
        """Sends the pseudo-gradient and waits for the average; False when a peer failed."""
        try:
            self._start(f)
            self._wait(f)
            return True
        except (terse.TransportError, terse.TimeoutError) as e:
            f.handle = None
            self._log(f"outer step {self.outer_steps}: the exchange failed: {e}")
            return False

    # ---- what _Recovery asks -----------------------------------------------------------------

    def _progress(self) -> int:
        return self.outer_steps

    def _module(self) -> torch.nn.Module:
        return getattr(self.model, "module", self.model)

    def _state(self) -> Dict[str, Any]:
        return {"steps": self.steps, "outer_steps": self.outer_steps,
                "global": [[g.detach().clone() for g in f.global_params]
                           for f in self.fragments],
                "outer": [f.outer.state_dict() for f in self.fragments],
                "inner": self.inner.state_dict(),
                "buffers": {n: b.detach().clone() for n, b in self._module().named_buffers()}}

    @torch.no_grad()
    def _load_state(self, state: Dict[str, Any], joiner: bool) -> None:
        for f, saved, outer in zip(self.fragments, state["global"], state["outer"]):
            for g, p, t in zip(f.global_params, f.params, saved):
                g.copy_(t)
                p.copy_(t)  # this member's model starts from the global parameters
            f.outer.load_state_dict(outer)
        self.inner.load_state_dict(state["inner"])
        buffers = dict(self._module().named_buffers())
        for n, t in state["buffers"].items():
            buffers[n].copy_(t)
        self.steps = int(state["steps"])
        self.outer_steps = int(state["outer_steps"])
        self._trained = False

    def _reconnect(self, comm: terse.Communicator) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            except terse.Error:
                pass  # a failed engine's pending work ends with errors, already seen
            self.engine = None
        for f in self.fragments:
            f.handle = None
        self._connect(comm, "terse.elastic.ElasticDiLoCo")

    def _digest(self) -> str:
        tensors: List[torch.Tensor] = []
        for f in self.fragments:
            tensors += list(f.global_params) + _optimizer_tensors(f.outer)
        return _digest(tensors) + f":{self.steps}:{self.outer_steps}"
