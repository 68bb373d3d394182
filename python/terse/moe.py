"""A mixture-of-experts layer whose experts are spread over the ranks, with its dispatch and
combine all-to-alls through terse (compressed) or through torch.distributed (exact).

Expert parallelism: ``world * experts_per_rank`` experts, each held by one rank. Every rank routes
its own tokens with a top-1 gate (Switch Transformer style, with a capacity per expert and the
load-balancing loss); a token's activations travel to the rank of its expert (dispatch, one
all-to-all), come back processed (combine, a second one), and the backward pass runs both in
reverse on the gradients. The exchange of a step is therefore four all-to-alls of
``world * experts_per_rank * capacity * width`` values per rank.

    exchange = terse.moe.TerseExchange(codec="fp16")      # or terse.moe.TorchExchange()
    layer = terse.moe.MoE(width=256, hidden=1024, experts_per_rank=2, exchange=exchange)

Activations differ every step, so the codecs that suit them have no error feedback: ``fp16``,
``bf16`` and ``minmax8`` (8 bits an element with a scale and offset per block). Each block is
encoded once by its sender and decoded by its receiver; a rank's own block does not travel.

The gate and everything outside the experts are replicated: average their gradients over the
ranks as data parallelism does (:func:`average_replicated_gradients`), while each expert's
gradient is its own rank's. Limits: one MoE call at a time per exchange (the calls of a step
run in order), float32 activations, CPU tensors.
"""

import math
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MoE", "TerseExchange", "TorchExchange", "average_replicated_gradients"]


class TorchExchange:
    """The exact all-to-all: ``torch.distributed.all_to_all_single`` over a process group."""

    def __init__(self, process_group: Optional[Any] = None) -> None:
        self.group = process_group
        self.seconds = 0.0  # time spent in exchanges so far
        self.calls = 0

    def __call__(self, x: torch.Tensor, name: str) -> torch.Tensor:
        import time

        start = time.perf_counter()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=self.group)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out

    def close(self) -> None:
        pass


class TerseExchange:
    """terse's all-to-all with ``codec`` on its own engine (over a terse Communicator of the
    process group's ranks, see :func:`terse.torch.communicator_for`); a collective to create.

    The tensor is split evenly by its first dimension, one block per rank in rank order."""

    def __init__(self, codec: str = "fp16", process_group: Optional[Any] = None,
                 timeout: Optional[float] = None, threads: int = 0) -> None:
        import terse
        import terse.torch

        terse.canonical_spec(codec)  # an unknown codec fails here, on every rank
        self.codec = codec
        self.comm = terse.torch.communicator_for(process_group, timeout=timeout)
        self.engine = terse.Engine(self.comm, terse.EngineOptions(threads=threads))
        self.world = self.comm.size
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, x: torch.Tensor, name: str) -> torch.Tensor:
        import time

        start = time.perf_counter()
        x = x.contiguous()
        if x.dtype != torch.float32:
            raise TypeError(f"terse.moe: all-to-all {name!r} of a {x.dtype} tensor; "
                            "activations must be float32")
        if x.shape[0] != self.world:
            raise ValueError(f"terse.moe: all-to-all {name!r} needs a first dimension of "
                             f"{self.world} (one block per rank), not {x.shape[0]}")
        out = torch.empty_like(x)
        counts = [x.numel() // self.world] * self.world
        self.engine.all_to_all(name, x.view(-1), counts, out.view(-1), counts,
                               codec=self.codec).wait()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out

    @property
    def bytes_sent(self) -> int:
        return self.engine.bytes_sent

    def close(self) -> None:
        self.engine.close()


class _AllToAll(torch.autograd.Function):
    """The exchange in the forward pass, and the same exchange of the gradients backwards (an
    even all-to-all is its own transpose)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, exchange: Any, name: str) -> torch.Tensor:
        ctx.exchange, ctx.name = exchange, name
        return exchange(x, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        return ctx.exchange(grad.contiguous(), ctx.name + "/grad"), None, None


class MoE(nn.Module):
    """A top-1 mixture-of-experts feed-forward layer over the ranks (see the module's doc).

    Input and output: ``[tokens, width]``. Each expert is ``Linear(width, hidden)``, ReLU,
    ``Linear(hidden, width)``. An expert takes at most ``capacity = ceil(capacity_factor *
    tokens / experts)`` tokens from each rank a step; the others are dropped (their output is
    zero, so a residual connection around the layer passes them on). ``aux_loss`` after each
    forward is the Switch Transformer's load-balancing loss (add a small multiple of it).
    ``name`` keeps the all-to-alls of several layers apart."""

    def __init__(self, width: int, hidden: int, experts_per_rank: int, exchange: Any,
                 capacity_factor: float = 1.25, name: str = "moe",
                 process_group: Optional[Any] = None) -> None:
        super().__init__()
        if experts_per_rank < 1:
            raise ValueError(f"experts_per_rank must be at least 1, not {experts_per_rank}")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive, not {capacity_factor}")
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.width, self.experts_per_rank = width, experts_per_rank
        self.experts_total = self.world * experts_per_rank
        self.capacity_factor = capacity_factor
        self.exchange, self.name = exchange, name
        self.gate = nn.Linear(width, self.experts_total)  # replicated: same seed on every rank
        # Each rank's experts are its own: drawn from a generator seeded by the rank.
        generator = torch.Generator().manual_seed(7919 * (self.rank + 1))
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
            for _ in range(experts_per_rank))
        with torch.no_grad():
            for expert in self.experts:
                for p in expert.parameters():
                    bound = 1 / math.sqrt(p.shape[-1] if p.dim() > 1 else width)
                    p.uniform_(-bound, bound, generator=generator)
        self.aux_loss = torch.zeros(())
        self.dropped = 0  # tokens dropped in the last forward

    def expert_parameters(self) -> List[nn.Parameter]:
        """This rank's experts' parameters (not replicated)."""
        return list(self.experts.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, width = x.shape
        experts = self.experts_total
        capacity = max(1, math.ceil(self.capacity_factor * tokens / experts))
        probs = F.softmax(self.gate(x), dim=-1)
        weight, expert = probs.max(dim=-1)
        # Switch's load-balancing loss: experts * sum_e (share of tokens to e) * (mean prob e).
        share = torch.bincount(expert, minlength=experts).to(x.dtype) / tokens
        self.aux_loss = experts * torch.sum(share * probs.mean(0))
        # Each token's place in its expert's queue (in token order); past capacity: dropped.
        one_hot = F.one_hot(expert, experts)
        position = ((one_hot.cumsum(0) - 1) * one_hot).sum(1)
        kept = position < capacity
        self.dropped = int((~kept).sum())
        slot = expert * capacity + position
        dispatch = x.new_zeros(experts * capacity, width)
        dispatch = dispatch.index_copy(0, slot[kept], x[kept])
        # [ranks, experts_per_rank * capacity * width]: block r goes to rank r.
        # Names carry the capacity: a tensor name keeps one size in the engine.
        received = _AllToAll.apply(dispatch.view(self.world, -1), self.exchange,
                                   f"{self.name}/dispatch/{capacity}")
        received = received.view(self.world, self.experts_per_rank, capacity, width)
        outputs = [self.experts[e](received[:, e].reshape(-1, width)).view(self.world, capacity,
                                                                          width)
                   for e in range(self.experts_per_rank)]
        processed = torch.stack(outputs, 1).view(self.world, -1)
        returned = _AllToAll.apply(processed, self.exchange, f"{self.name}/combine/{capacity}")
        returned = returned.view(experts * capacity, width)
        out = x.new_zeros(tokens, width)
        out = out.index_copy(0, torch.nonzero(kept).squeeze(1),
                             returned[slot[kept]] * weight[kept].unsqueeze(1))
        return out


def average_replicated_gradients(model: nn.Module, process_group: Optional[Any] = None) -> None:
    """Averages the gradients of every parameter but the MoE layers' experts over the ranks
    (one allreduce of them all, exact), and divides the experts' gradients by the world size:
    each rank's loss is the mean over its own tokens, so the global mean's gradient is the sum
    over ranks divided by their number, and an expert's gradient already sums its tokens' from
    every rank."""
    world = dist.get_world_size(process_group)
    experts = {id(p) for m in model.modules() if isinstance(m, MoE)
               for p in m.expert_parameters()}
    shared = [p for p in model.parameters() if p.grad is not None and id(p) not in experts]
    if shared:
        flat = torch.cat([p.grad.reshape(-1) for p in shared])
        dist.all_reduce(flat, group=process_group)
        flat /= world
        offset = 0
        for p in shared:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
    for p in model.parameters():
        if id(p) in experts and p.grad is not None:
            p.grad /= world
