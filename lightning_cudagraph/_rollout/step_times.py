"""The times a fit is judged by: every training step's, the eager baseline, and each level's steps on graphs.

All come from the backend's timer (CUDA events, read once per log interval or decision: no host sync per step). A
step's time runs from the end of the step before, so Lightning's work between steps counts as it does in training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_cudagraph._backend.timing import StepTimer, median
from lightning_cudagraph._rollout.ladder import MEASURE_STEPS
from lightning_cudagraph.health import CUDAGraphReport

__all__ = ["FitSteps", "LevelRun"]


class FitSteps:
    """Every training step's time (``timer``, started and stopped by the runner): the logged median, the eager ones.

    ``report.step_ms`` mirrors the median of each log interval.
    """

    def __init__(self, timer: StepTimer, report: CUDAGraphReport) -> None:
        self.timer, self.report = timer, report
        self._eager: list[float] | None = []  # eager step times until the baseline is taken (then None)

    def read_interval(self, eager: bool) -> None:
        """Once per log interval: read the steps (one host sync); ``eager``: warmup steps, kept for the baseline."""
        times = self.timer.read()
        if eager and self._eager is not None:
            self._eager.extend(times)
        elif times:
            self.report.step_ms = median(times)

    def eager_median(self, reference: list[float] | None = None) -> float | None:
        """Right before the first capture: the median eager step time, once (``None`` after).

        That of the ``reference`` steps if any (``scope="auto"``), else of the eager steps so far, the first left out
        (it compiles kernels and fills caches).
        """
        if self._eager is None:
            return None
        times, self._eager = [*self._eager, *self.timer.read()], None
        if reference:
            return median(reference)
        return median(times[1:] if len(times) > 1 else times)


@dataclass
class LevelRun:
    """A level's steps on graphs under ``scope="auto"``: how many ran since its capture, and those timed.

    A step counts when it replays the level's graphs once they are confirmed: confirming steps also run the parity
    checks' eager forwards, which would make a level look slower (and its timing noisier) than it is.

    Attributes:
        window: Times the level's steps (shared by the levels of a fit; a new level drops a partial window).
        capture_mark: The fit's capture time when the level began (its row gets the captures since).
        due: Steps timed (``measured``) before the decision.
        times: Their times, read so far (ms).
        earlier: Medians of the level's earlier windows (a level far slower than the bar is timed twice).

    Example:
        >>> run = LevelRun(StepTimer(use_cuda=False), capture_mark=0.0)
        >>> run.step_started(replaying=True); run.step_ended(on_graphs=True)  # the level's first step on graphs
        >>> run.step_started(replaying=True); run.step_ended(on_graphs=True)
        >>> run.since_capture, run.measured, len(run.read())
        (2, 1, 1)
    """

    window: StepTimer
    capture_mark: float
    since_capture: int = 0
    timing: bool = False
    measured: int = 0
    due: int = MEASURE_STEPS
    times: list[float] = field(default_factory=list)
    earlier: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.window.read()  # drop a partial window of the level before

    def step_started(self, replaying: bool) -> None:
        """A step starts: it is timed when it replays confirmed graphs, after the level's first step on them."""
        self.timing = replaying and self.since_capture >= 1

    def step_ended(self, on_graphs: bool) -> None:
        """A step ended: count it, and start timing the next one once the level runs on graphs."""
        self.since_capture += on_graphs
        if self.timing:
            self.window.stop()
            self.measured += 1
        if on_graphs and self.since_capture >= 1:
            self.window.start()
        else:  # an eager step between (the steady-state check's): the step after it is not timed from before it
            self.window.cancel()

    def captures_since(self, total: float) -> float:
        """The capture time since the mark, given the fit's total so far; the mark moves to ``total``."""
        since, self.capture_mark = total - self.capture_mark, total
        return since

    def read(self) -> list[float]:
        """Every timed step's time so far (one host sync)."""
        self.times.extend(self.window.read())
        return self.times

    def time_again(self, steps: int, window_ms: float) -> None:
        """Keep this window's figure (``window_ms``: agreed by every rank) and time another window of ``steps``."""
        self.earlier.append(window_ms)
        self.times = []
        self.due = self.measured + steps
