"""Step times without a host sync per step: CUDA events recorded at step start and end, read in bulk."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

__all__ = ["StepTimer", "median"]


class StepTimer:
    """Step times from CUDA events recorded on the current stream, read in bulk (or host time without CUDA)."""

    def __init__(self, use_cuda: bool, capacity: int = 256) -> None:
        self._use_cuda = use_cuda
        self._capacity = capacity
        #: Marks are host times (floats) without CUDA, CUDA events with it.
        self._pending: list[tuple[Any, Any]] = []
        self._open: Any = None
        self._free: list[torch.cuda.Event] = []

    def start(self) -> None:
        """Mark the start of a step."""
        self._open = self._mark()

    def stop(self) -> None:
        """Mark the end of the step started last."""
        if self._open is None:
            return
        self._pending.append((self._open, self._mark()))
        self._open = None
        if len(self._pending) > self._capacity:
            self._recycle(self._pending.pop(0))

    def cancel(self) -> None:
        """Forget the step started last (it is not to be timed)."""
        self._open = None

    def read(self) -> list[float]:
        """Milliseconds of every step since the last read (one host sync on CUDA)."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        if not self._use_cuda:
            return [(end - begin) * 1e3 for begin, end in pending]
        pending[-1][1].synchronize()
        times = [begin.elapsed_time(end) for begin, end in pending]
        for pair in pending:
            self._recycle(pair)
        return times

    def _mark(self) -> Any:
        if not self._use_cuda:
            return time.perf_counter()
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _recycle(self, pair: tuple[Any, Any]) -> None:
        if self._use_cuda:
            self._free.extend(pair)


def median(values: list[float]) -> float:
    """The median, or ``nan`` for no values."""
    return statistics.median(values) if values else math.nan
