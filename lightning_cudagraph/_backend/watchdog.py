"""The replay watchdog: a replayed step that never finishes ends the process instead of hanging every rank.

Since PyTorch 2.2, NCCL's own watchdog does not see collectives inside a CUDA graph, so a rank that stops replaying
leaves the others waiting in a replayed collective forever. A thread polls a marker (CUDA event) behind each replay;
one late past the bound aborts the process groups and, unless training raises within a grace period, exits with
:data:`EXIT_CODE` for the launcher to report.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch.distributed as dist

__all__ = ["EXIT_CODE", "Marker", "ReplayWatchdog", "replay_bound_s"]

log = logging.getLogger(__name__)

#: The exit status of a process the watchdog ended (EX_SOFTWARE).
EXIT_CODE = 70
#: The bound is never shorter than this: a slow step, a log flush or a checkpoint must not trip it.
MIN_BOUND_S = 120.0
#: Otherwise, this many measured eager steps.
STEPS_IN_BOUND = 100
#: How long training has, after the watchdog fired, to raise on its own before the process is ended.
GRACE_S = 30.0


class Marker(Protocol):
    """What the backend records behind a replay: ``query()`` is True once the device finished the work before it."""

    def query(self) -> bool:
        """Whether the work recorded before the marker finished (non-blocking)."""


def replay_bound_s(eager_step_ms: float, timeout_s: float | None = None) -> float:
    """How long a replayed step may take before the watchdog fires: ``timeout_s`` if given, else generous.

    Generous is ``STEPS_IN_BOUND`` eager steps, at least ``MIN_BOUND_S``.
    """
    if timeout_s is not None:
        return timeout_s
    if not math.isfinite(eager_step_ms):
        return MIN_BOUND_S
    return max(MIN_BOUND_S, STEPS_IN_BOUND * eager_step_ms / 1000)


class ReplayWatchdog:
    """Watches replayed steps from a thread of its own; one that does not finish within ``bound_s`` ends the process.

    Args:
        bound: Seconds a replay may take; read at the first replay (the eager step time is measured by then).
        rank: This process's rank, named in the message.
        marker: Records a marker behind the work launched so far (a CUDA event on the training stream).
        grace_s: After firing, how long training has to raise on its own (``None``: :data:`GRACE_S`).
        end: Ends the process (``os._exit``; a test passes its own).
    """

    def __init__(
        self,
        bound: Callable[[], float],
        rank: int,
        marker: Callable[[], Marker],
        grace_s: float | None = None,
        end: Callable[[int], object] = os._exit,
    ) -> None:
        self.rank, self.grace_s = rank, GRACE_S if grace_s is None else grace_s
        self._bound, self._marker, self._end = bound, marker, end
        #: Seconds a replay may take (known from the first replay on).
        self.bound_s = math.inf
        #: Why the watchdog fired (``None`` while every replay finished in time).
        self.fired: str | None = None
        #: Replays launched and not yet seen finished: [step, launch time, marker or None while launching].
        self._pending: deque[list] = deque()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def started(self, step: int) -> None:
        """A replay of ``step`` is about to launch."""
        with self._lock:
            self._pending.append([step, time.monotonic(), None])
        if self._thread is None:
            self.bound_s = self._bound()
            self._thread = threading.Thread(target=self._watch, name="cudagraph-replay-watchdog", daemon=True)
            self._thread.start()

    def finished(self) -> None:
        """The replay launched last returned to the host: its marker tells when the device is done with it."""
        marker = self._marker()
        with self._lock:
            if self._pending:
                self._pending[-1][2] = marker

    def close(self) -> None:
        """Stop watching (graphs released, the fit over, or training raised after the watchdog fired)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _watch(self) -> None:
        poll_s = min(1.0, self.bound_s / 10)
        while not self._closed.wait(poll_s):
            late = self._oldest_unfinished()
            if late is not None:
                self._fire(*late)
                return

    def _oldest_unfinished(self) -> tuple[int, float] | None:
        """The step and wait of the oldest replay past the bound, once the finished ones are dropped."""
        now = time.monotonic()
        with self._lock:
            while self._pending and self._pending[0][2] is not None and self._pending[0][2].query():
                self._pending.popleft()
            if self._pending and now - self._pending[0][1] > self.bound_s:
                return self._pending[0][0], now - self._pending[0][1]
        return None

    def _fire(self, step: int, waited_s: float) -> None:
        self.fired = (
            f"replay watchdog: rank {self.rank} waited {waited_s:.0f} s for replayed step {step} to finish (bound"
            f" {self.bound_s:.0f} s). A rank stopped replaying (it died, raised, or ran the step eagerly alone), so"
            " the collectives inside the graph wait for it; NCCL's own watchdog does not see collectives in a graph."
            " The process groups are aborted and this process ends instead of hanging"
        )
        log.error(self.fired)  # on stderr where logging is not configured (Python's last-resort handler)
        abort_collectives()
        if not self._closed.wait(self.grace_s):  # training did not raise on its own: it is stuck in the replay
            self._end(EXIT_CODE)


def abort_collectives() -> None:
    """Abort every process group where the backend can (NCCL), so that ranks blocked in a collective return."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        return
    try:
        abort()
    except Exception as error:  # gloo cannot abort: the process is ended after the grace period instead
        log.warning("replay watchdog: the process groups could not be aborted (%s)", error)
