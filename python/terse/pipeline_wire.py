"""The messages of one pipeline stage (:mod:`terse.pipeline`): a channel per neighbour and
direction, the sends in flight, and the step header every stage passes on."""

from typing import List, Optional, Sequence, Tuple

import torch

import terse
from terse.pipeline_profile import Measurements

__all__ = ["Wire"]

_HEADER_MAGIC = 7151.0  # first element of every step header ("terse pipeline")
_FLAG_INDICES = 1
_FLAG_EVAL = 2


class Wire:
    """This stage's links to the previous stage (``prev``, None on the first) and the next
    (``next``, None on the last); messages are named by kind and boundary, and every send's
    bytes and encoding time go into ``measured``."""

    def __init__(self, comm: terse.Communicator, seed: int, rank: int, stage: int,
                 prev: Optional[int], next: Optional[int], measured: Measurements) -> None:
        self.rank, self.stage, self.prev, self.next = rank, stage, prev, next
        self.measured = measured
        # One channel per neighbour and direction: a Channel completes messages on two threads
        # in posting order, and a send completes only once the peer posted the matching
        # receive, so sends and receives sharing threads could wait on each other across
        # stages (1F1B) until the timeout.
        self.channels: List[terse.Channel] = []

        def channel() -> terse.Channel:
            c = terse.Channel(comm, seed=seed)
            self.channels.append(c)
            return c

        self.to_next = channel() if next is not None else None
        self.from_next = channel() if next is not None else None
        self.to_prev = channel() if prev is not None else None
        self.from_prev = channel() if prev is not None else None
        self.pending: List[terse.Handle] = []

    @staticmethod
    def _name(kind: str, boundary: int) -> str:
        return f"pipeline/{kind}{boundary}"

    def _send(self, channel: terse.Channel, peer: int, kind: str, boundary: int,
              x: torch.Tensor, codec: str) -> None:
        x = x.detach()
        if not x.is_contiguous():
            x = x.contiguous()
        name = self._name(kind, boundary)
        before = channel.bytes_sent
        with self.measured.phase(f"encode_{kind}"):
            handle = channel.send(peer, name, x, codec)
        self.measured.count_bytes(kind, channel.bytes_sent - before)
        self.pending.append(handle)

    def send_next(self, kind: str, boundary: int, x: torch.Tensor, codec: str) -> None:
        self._send(self.to_next, self.next, kind, boundary, x, codec)

    def send_prev(self, kind: str, boundary: int, x: torch.Tensor, codec: str) -> None:
        self._send(self.to_prev, self.prev, kind, boundary, x, codec)

    def _recv(self, channel: terse.Channel, peer: int, kind: str, boundary: int,
              shape: Sequence[int], codec: str) -> Tuple[torch.Tensor, terse.Handle]:
        out = torch.empty(tuple(shape), dtype=torch.float32)
        return out, channel.recv(peer, self._name(kind, boundary), out, codec)

    def recv_prev(self, kind: str, boundary: int, shape: Sequence[int],
                  codec: str) -> Tuple[torch.Tensor, terse.Handle]:
        return self._recv(self.from_prev, self.prev, kind, boundary, shape, codec)

    def recv_next(self, kind: str, boundary: int, shape: Sequence[int],
                  codec: str) -> Tuple[torch.Tensor, terse.Handle]:
        return self._recv(self.from_next, self.next, kind, boundary, shape, codec)

    def wait(self, handle: terse.Handle, what: str) -> None:
        with self.measured.phase(f"wait_{what}"):
            handle.wait()

    def finish_sends(self) -> None:
        handles, self.pending = self.pending, []
        for h in handles:
            self.wait(h, "send")

    def header(self, calls: int, batch: int, indices: Optional[torch.Tensor], eval_mode: bool
               ) -> Tuple[int, Optional[torch.Tensor], bool]:
        """Stage 0 states the step (batch size, sample indices); the others receive it from
        their predecessor and pass it on before computing, so every stage can post its receives
        for the whole step at once. ``calls`` counts the stage's steps and predictions, which
        every stage counts alike."""
        if self.prev is not None:
            head, handle = self.recv_prev("header", self.stage - 1, (4,), "none")
            self.wait(handle, "header")
            if head[0].item() != _HEADER_MAGIC or int(head[1].item()) != (calls & 0xffffff):
                raise terse.MismatchError(
                    f"rank {self.rank}: step header from peer {self.prev} says call "
                    f"{int(head[1].item())} (magic {head[0].item()}), this stage is at call "
                    f"{calls}: do all stages call step() and predict() alike?")
            batch, flags = int(head[2].item()), int(head[3].item())
            eval_mode = bool(flags & _FLAG_EVAL)
            indices = None
            if flags & _FLAG_INDICES:
                packed, handle = self.recv_prev("indices", self.stage - 1, (2, batch), "none")
                self.wait(handle, "header")
                indices = packed[0].to(torch.int64) * 65536 + packed[1].to(torch.int64)
        if self.next is not None:
            flags = (_FLAG_INDICES if indices is not None else 0) | (_FLAG_EVAL if eval_mode
                                                                      else 0)
            head = torch.tensor([_HEADER_MAGIC, float(calls & 0xffffff), float(batch),
                                 float(flags)])
            self.send_next("header", self.stage, head, "none")
            if indices is not None:
                packed = torch.stack([(indices // 65536).float(), (indices % 65536).float()])
                self.send_next("indices", self.stage, packed, "none")
        return batch, indices, eval_mode

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.channels if not c.closed)

    def close(self) -> None:
        for c in self.channels:
            c.close()
