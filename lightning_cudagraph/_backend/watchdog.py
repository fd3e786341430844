"""The replay watchdog: a replayed step that never finishes ends the process instead of hanging every rank.

Since PyTorch 2.2, NCCL's own watchdog does not see collectives inside a CUDA graph, so a rank that stops replaying
leaves the others waiting in a replayed collective forever. A thread polls a marker (CUDA event) behind each replay;
one late past the bound aborts the process groups and, unless training raises within a grace period, exits with
:data:`EXIT_CODE` for the launcher to report.

The bound is never below a floor of measured steps: a bound shorter than a healthy step would end healthy fits.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from lightning_cudagraph._warnings import warn_user

__all__ = ["EXIT_CODE", "Marker", "ReplayWatchdog", "StepTimes", "replay_bound_s", "replay_floor_s"]

log = logging.getLogger(__name__)

#: The exit status of a process the watchdog ended (EX_SOFTWARE).
EXIT_CODE = 70
#: The default bound is never shorter than this: a slow step, a log flush or a checkpoint must not trip it.
MIN_BOUND_S = 120.0
#: Otherwise, this many measured eager steps.
STEPS_IN_BOUND = 100
#: No bound, ``replay_timeout_s`` included, is shorter than this many measured steps (eager or replayed)...
STEPS_IN_FLOOR = 10
#: ... nor shorter than this (a fast step's time says little about a log flush or a slow host).
MIN_FLOOR_S = 1.0
#: How long training has, after the watchdog fired, to raise on its own before the process is ended.
GRACE_S = 30.0


class Marker(Protocol):
    """What the backend records behind a replay: ``query()`` is True once the device finished the work before it."""

    def query(self) -> bool:
        """Whether the work recorded before the marker finished (non-blocking)."""


class StepTimes(Protocol):
    """The fit's measured step times in ms, ``nan`` until measured (:class:`~lightning_cudagraph.CUDAGraphReport`).

    Attributes:
        eager_step_ms: The median eager step before the first capture.
        step_ms: The median step of the last log interval (replayed steps once the graphs replay).
    """

    eager_step_ms: float
    step_ms: float


def replay_bound_s(eager_step_ms: float, timeout_s: float | None = None) -> float:
    """The bound asked for, before the floor: ``timeout_s`` if given, else generous.

    Generous is ``STEPS_IN_BOUND`` eager steps, at least ``MIN_BOUND_S``.
    """
    if timeout_s is not None:
        return timeout_s
    if not math.isfinite(eager_step_ms):
        return MIN_BOUND_S
    return max(MIN_BOUND_S, STEPS_IN_BOUND * eager_step_ms / 1000)


def replay_floor_s(step_ms: float) -> float:
    """The shortest bound the watchdog keeps: ``STEPS_IN_FLOOR`` steps of ``step_ms``, at least ``MIN_FLOOR_S``."""
    if not math.isfinite(step_ms):
        return MIN_FLOOR_S
    return max(MIN_FLOOR_S, STEPS_IN_FLOOR * step_ms / 1000)


def duration(seconds: float) -> str:
    """``seconds`` for a message: in ms below one second (``0.3`` is "300 ms", never "0 s")."""
    if seconds < 1:
        ms = seconds * 1000
        return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"


@dataclass
class _Replay:
    """A replay launched and not yet seen finished.

    Attributes:
        step: The global step it replays.
        launched: When its launch began (host time).
        turn: When its turn on the device came: its launch, or the end of the replay before it if that came later.
        marker: Recorded behind it once its launch returned (``None`` while launching).
    """

    step: int
    launched: float
    turn: float
    marker: Marker | None = None


class ReplayWatchdog:
    """Watches replayed steps from a thread of its own; one that does not finish within the bound ends the process.

    The bound is ``timeout_s`` (else the default of :func:`replay_bound_s`), raised to the floor of
    :func:`replay_floor_s` over the longest step measured: the eager step, the replayed step and a replay call's host
    time. A ``timeout_s`` raised to the floor is warned about once. Each replay is timed from its turn on the device.

    Args:
        timeout_s: Seconds a replay may take (``replay_timeout_s``); ``None``: the default bound.
        times: The fit's measured step times, read before each replay.
        rank: This process's rank, named in the messages.
        marker: Records a marker behind the work launched so far (a CUDA event on the training stream).
        grace_s: After firing, how long training has to raise on its own (``None``: :data:`GRACE_S`).
        end: Ends the process (``os._exit``; a test passes its own).
    """

    def __init__(
        self,
        timeout_s: float | None,
        times: StepTimes,
        rank: int,
        marker: Callable[[], Marker],
        grace_s: float | None = None,
        end: Callable[[int], object] = os._exit,
    ) -> None:
        self.timeout_s, self.rank, self.grace_s = timeout_s, rank, GRACE_S if grace_s is None else grace_s
        self._times, self._marker, self._end = times, marker, end
        #: Seconds a replay may take (known from the first replay on).
        self.bound_s = math.inf
        #: The longest step measured so far, in ms (``nan`` before any).
        self.step_ms = math.nan
        #: Why the watchdog fired (``None`` while every replay finished in time).
        self.fired: str | None = None
        self._longest_call_ms = math.nan
        self._warned = False
        self._pending: deque[_Replay] = deque()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def started(self, step: int) -> None:
        """A replay of ``step`` is about to launch."""
        self._update_bound()
        now = time.monotonic()
        with self._lock:
            self._pending.append(_Replay(step, now, now))
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="cudagraph-replay-watchdog", daemon=True)
            self._thread.start()

    def finished(self) -> None:
        """The replay launched last returned to the host: its marker tells when the device is done with it."""
        marker = self._marker()
        now = time.monotonic()
        with self._lock:
            if self._pending:
                last = self._pending[-1]
                last.marker = marker
                # On a device without streams (gloo on the CPU) the call is the whole replayed step.
                self._longest_call_ms = _longest(self._longest_call_ms, (now - last.launched) * 1000)

    def close(self) -> None:
        """Stop watching (graphs released, the fit over, or training raised after the watchdog fired)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    @property
    def which(self) -> str:
        """Which bound is in force, in words: ``replay_timeout_s``, the default, or the floor above either."""
        floor = (
            f"the floor of {STEPS_IN_FLOOR} measured steps, at least {duration(MIN_FLOOR_S)}"
            f" (the longest step measured took {self._measured()})"
        )
        asked = replay_bound_s(self._times.eager_step_ms, self.timeout_s)
        if self.bound_s > asked:
            if self.timeout_s is None:
                return f"{floor}, above the default"
            return f"{floor}, above replay_timeout_s={duration(self.timeout_s)}"
        if self.timeout_s is not None:
            return f"replay_timeout_s={duration(self.timeout_s)}"
        return f"the default ({STEPS_IN_BOUND} eager steps, at least {duration(MIN_BOUND_S)})"

    def _update_bound(self) -> None:
        """Read the step times measured since the last replay; raise the bound to their floor, warning once."""
        for ms in (self._times.eager_step_ms, self._times.step_ms, self._longest_call_ms):
            self.step_ms = _longest(self.step_ms, ms)
        asked = replay_bound_s(self._times.eager_step_ms, self.timeout_s)
        floor = replay_floor_s(self.step_ms)
        if self.timeout_s is not None and floor > asked and not self._warned:
            self._warned = True
            warn_user(
                f"replay watchdog: rank {self.rank}: replay_timeout_s={duration(self.timeout_s)} is below the floor"
                f" of {STEPS_IN_FLOOR} measured steps, at least {duration(MIN_FLOOR_S)} (the longest step measured"
                f" took {self._measured()}); the bound is raised to {duration(floor)}, and follows the steps measured"
                " from now on, so that a healthy fit is not ended. Pass a larger replay_timeout_s, or None for the"
                " default bound",
                all_ranks=True,
            )
        self.bound_s = max(asked, floor)

    def _measured(self) -> str:
        return duration(self.step_ms / 1000) if math.isfinite(self.step_ms) else "no step measured yet"

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.bound_s / 10)):
            late = self._oldest_unfinished()
            if late is not None:
                self._fire(*late)
                return

    def _oldest_unfinished(self) -> tuple[int, float] | None:
        """The step and wait of the oldest replay past the bound since its turn, once the finished ones are dropped."""
        now = time.monotonic()
        with self._lock:
            while self._pending and self._pending[0].marker is not None and self._pending[0].marker.query():
                self._pending.popleft()
                if self._pending:  # the next replay's turn on the device came when this one ended (a poll late at most)
                    self._pending[0].turn = max(self._pending[0].turn, now)
            if self._pending and now - self._pending[0].turn > self.bound_s:
                return self._pending[0].step, now - self._pending[0].turn
        return None

    def _fire(self, step: int, waited_s: float) -> None:
        self.fired = (
            f"replay watchdog: rank {self.rank} waited {duration(waited_s)} for replayed step {step} to finish"
            f" (bound {duration(self.bound_s)}). The bound is {self.which}; it is at least {STEPS_IN_FLOOR} measured"
            " steps, so a rank stopped replaying (it died, raised, or ran the step eagerly alone) and the collectives"
            " inside the graph wait for it; NCCL's own watchdog does not see collectives in a graph. The process"
            " groups are aborted and this process ends instead of hanging"
        )
        log.error(self.fired)  # on stderr where logging is not configured (Python's last-resort handler)
        abort_collectives()
        if not self._closed.wait(self.grace_s):  # training did not raise on its own: it is stuck in the replay
            self._end(EXIT_CODE)


def _longest(ms: float, other: float) -> float:
    """The longer of two times, ``nan`` (not measured) counting as neither."""
    if not math.isfinite(other):
        return ms
    return other if not math.isfinite(ms) else max(ms, other)


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
