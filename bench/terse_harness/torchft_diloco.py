"""torchft's DiLoCo (PyPI ``torchft``) behind the interface the training harness gives
``terse.diloco.DiLoCo``: the baseline it races.

Every rank is one worker, a torchft replica group of size 1: :func:`make` starts a torchft
Lighthouse on rank 0 (in process), then on every rank its own TCP store, a ``Manager`` with
``replica_id`` = rank and a reconfigurable ``ProcessGroupGloo`` over the replicas, and
torchft's ``DiLoCo`` on the inner optimizer's step hooks. The default process group
(torch.distributed, already initialized) carries only the Lighthouse's address and barriers.

Limits: fp32 pseudo-gradients (torchft's ``should_quantize`` needs a GPU: on CPU its
``Manager.allreduce`` fails in ``torch.accelerator.current_stream()``, swallows the error and
every ``should_commit`` is False, so no outer step is ever applied); the outer
optimizer is Nesterov SGD; torchft's per-fragment schedule starts a fragment's exchange ``delay``
steps before its slot and merges it at the slot (terse starts at the slot and merges ``delay``
steps later); the bytes sent are not counted here (``bytes_sent`` is None).
"""

import copy
import os
import socket
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Union

import torch


def _own_address(master: str) -> str:
    """The address of this host on the route to ``master`` (what the other ranks reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, 9))  # UDP: no packet is sent
        return s.getsockname()[0]


def _fragments(module: torch.nn.Module,
               fragments: Union[int, Sequence[Sequence[str]]]) -> List[torch.nn.Module]:
    """The model's trainable parameters as modules of one fragment each (holding the model's own
    parameter objects): ``fragments`` contiguous runs of about equal size in model order, or the
    given lists of parameter names."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if isinstance(fragments, int):
        if not 1 <= fragments <= len(named):
            raise ValueError(f"torchft_diloco: fragments must be in [1, {len(named)}], "
                             f"not {fragments}")
        total, done, runs = sum(p.numel() for _, p in named), 0, [[]]
        for i, (name, p) in enumerate(named):
            left = fragments - len(runs)
            if runs[-1] and left > 0 and (len(named) - i == left or
                                          done + p.numel() / 2 > len(runs) * total / fragments):
                runs.append([])
            runs[-1].append(name)
            done += p.numel()
    else:
        runs = [list(names) for names in fragments]
    by_name = dict(named)
    covered = [n for run in runs for n in run]
    if sorted(covered) != sorted(by_name):
        raise ValueError("torchft_diloco: the fragments must cover every trainable parameter "
                         "once")
    # ParameterDicts hold the model's own parameter objects (names may not contain dots).
    parts = [torch.nn.ParameterDict({n.replace(".", "/"): by_name[n] for n in run})
             for run in runs]
    return parts


class TorchftDiLoCo:
    """torchft's DiLoCo on one rank; made by :func:`make`. The interface of
    ``terse.diloco.DiLoCo`` the harness uses: zero_grad, step, param_groups, finish,
    global_model, stats, bytes_sent, close."""

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, *,
                 sync_every: int, outer_lr: float, outer_momentum: float,
                 fragments: Union[int, Sequence[Sequence[str]]], delay: int,
                 timeout: float) -> None:
        import torch.distributed as dist

        # torchft's Rust servers log every quorum and commit at INFO; warnings are enough here.
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft import Manager, ProcessGroupGloo
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo

        if not dist.is_initialized():
            raise RuntimeError("torchft_diloco: torch.distributed must be initialized")
        self.model = model
        self.module = getattr(model, "module", model)
        self.inner = inner
        self.delay = delay
        rank, world = dist.get_rank(), dist.get_world_size()
        master = os.environ.get("MASTER_ADDR", "127.0.0.1")
        wait = timedelta(seconds=timeout)

        # The Lighthouse on rank 0, on a port the OS picks, its address sent to every rank.
        self.lighthouse = None
        port = [0]
        if rank == 0:
            self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world,
                                               join_timeout_ms=int(timeout * 1000))
            port = [int(self.lighthouse.address().rsplit(":", 1)[1])]
        dist.broadcast_object_list(port, src=0)
        here = _own_address(master)
        # Each replica group's own store (torchft's Manager writes fixed keys into it); the
        # quorum's primary store also hosts the replicas' Gloo rendezvous.
        self.store = dist.TCPStore(here, 0, is_master=True, wait_for_workers=False,
                                   timeout=wait)
        self.pg = ProcessGroupGloo(timeout=wait)
        self.manager = Manager(
            pg=self.pg, load_state_dict=None, state_dict=None, min_replica_size=world,
            use_async_quorum=False, timeout=wait, quorum_timeout=wait, connect_timeout=wait,
            rank=0, world_size=1, store_addr=here, store_port=self.store.port,
            lighthouse_addr=f"http://{master}:{port[0]}", replica_id=f"terse_bench_{rank}",
            hostname=here, init_sync=False)
        self.parts = _fragments(self.module, fragments)
        self.outer = [torch.optim.SGD(part.parameters(), lr=outer_lr, momentum=outer_momentum,
                                      nesterov=True) for part in self.parts]
        # Hooks around torchft's post-step hook time what the outer steps add to step().
        self._waited = 0.0
        self._mark = 0.0
        self._hooks = [inner.register_step_post_hook(self._before_outer)]
        self.diloco = DiLoCo(self.manager, self.parts, inner, self.outer,
                             sync_every=sync_every, fragment_sync_delay=delay)
        self.diloco.__enter__()
        self._hooks.append(inner.register_step_post_hook(self._after_outer))
        dist.barrier()

    def _before_outer(self, *_: Any) -> None:
        self._mark = time.perf_counter()

    def _after_outer(self, *_: Any) -> None:
        self._waited += time.perf_counter() - self._mark

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.inner.param_groups

    def step(self, closure: Optional[Any] = None) -> Any:
        """The inner step; torchft's hook runs its outer steps when due."""
        return self.inner.step(closure) if closure is not None else self.inner.step()

    def finish(self) -> None:
        """Nothing to merge: an exchange torchft started within ``delay`` steps of the end is
        left unmerged, as torchft leaves it (the global parameters are those of the last outer
        step)."""

    def global_parameters(self) -> Dict[str, torch.Tensor]:
        """The global parameters by the model's names: torchft's backup copies of them (each
        fragment's ``original_parameters``, as of its last outer step)."""
        out = {}
        for fragment in self.diloco._fragments:
            for name, t in fragment.original_parameters.items():
                out[name.replace("/", ".")] = t
        return out

    def global_model(self) -> torch.nn.Module:
        """A copy of the model holding the global parameters: what to evaluate."""
        module = copy.deepcopy(self.module)
        params = dict(module.named_parameters())
        with torch.no_grad():
            for name, t in self.global_parameters().items():
                params[name].copy_(t)
        return module

    def stats(self) -> Dict[str, Any]:
        """``outer_steps`` (fragment outer steps committed), ``waited_seconds`` (what torchft's
        hook added to the steps: quorum, exchange, commit and outer step);
        ``exchange_seconds`` equals it with delay 0 (then nothing is hidden) and is unknown
        otherwise."""
        synchronous = self.delay == 0
        return {"outer_steps": self.manager.current_step(), "bytes_sent": None,
                "exchange_seconds": self._waited if synchronous else None,
                "waited_seconds": self._waited, "hidden": 0.0 if synchronous else None}

    @property
    def bytes_sent(self) -> Optional[int]:
        return None

    def close(self) -> None:
        """Removes the hooks, shuts the Manager and rank 0's Lighthouse down."""
        import torch.distributed as dist

        self.diloco.__exit__(None, None, None)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        dist.barrier()  # no Manager goes before every replica is done with the Lighthouse
        self.manager.shutdown(wait=False)
        self.pg.shutdown()
        dist.barrier()
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def make(model: torch.nn.Module, inner: torch.optim.Optimizer, *, sync_every: int,
         outer_lr: float = 0.7, outer_momentum: float = 0.9,
         fragments: Union[int, Sequence[Sequence[str]]] = 1, delay: int = 0,
         timeout: float = 300.0) -> TorchftDiLoCo:
    """torchft's DiLoCo over ``model`` (its module if DDP) and its ``inner`` optimizer, with
    H = ``sync_every``, Nesterov SGD(``outer_lr``, ``outer_momentum``) per fragment,
    ``fragments`` (a count or lists of parameter names; H must be a multiple of their number)
    and ``delay`` (tau < H / fragments). Every rank calls it alike after
    torch.distributed.init_process_group, with the same initial parameters (torchft's initial
    synchronization is off)."""
    return TorchftDiLoCo(model, inner, sync_every=sync_every, outer_lr=outer_lr,
                         outer_momentum=outer_momentum, fragments=fragments, delay=delay,
                         timeout=timeout)
