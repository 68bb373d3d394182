"""A pipeline stage's profile (:meth:`terse.pipeline.Pipeline.profile`): wall and CPU time of
named phases, bytes by message kind and step times, between resets."""

import time
from typing import Any, Dict, List

__all__ = ["Measurements", "Phase", "Timer"]


class Timer:
    """Per-step sums of wall and CPU time of named phases (the profile)."""

    def __init__(self) -> None:
        self.wall: Dict[str, float] = {}
        self.cpu: Dict[str, float] = {}
        self.count: Dict[str, int] = {}

    def add(self, name: str, wall: float, cpu: float) -> None:
        self.wall[name] = self.wall.get(name, 0.0) + wall
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu
        self.count[name] = self.count.get(name, 0) + 1


class Phase:
    def __init__(self, timer: Timer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.w, self.c = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc: Any) -> None:
        self.timer.add(self.name, time.perf_counter() - self.w, time.thread_time() - self.c)


class Measurements:
    """What a stage measured since the last :meth:`reset`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.timer = Timer()
        self.step_seconds: List[float] = []
        self.bytes_by_message: Dict[str, int] = {}

    def phase(self, name: str) -> Phase:
        """A context manager adding a block's wall and CPU time to phase ``name``."""
        return Phase(self.timer, name)

    def count_bytes(self, kind: str, n: int) -> None:
        self.bytes_by_message[kind] = self.bytes_by_message.get(kind, 0) + n
