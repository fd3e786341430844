"""The decisions of the ladder: which level is on, which was best, where to go next. Pure bookkeeping.

A fixed scope is a one-level ladder: settled from the start, untimed, with no rows in the report. Under
``scope="auto"`` each level is captured, confirmed like any graph, then timed over :data:`MEASURE_STEPS` steps on
its graphs (CUDA events read once per decision). The figure is the median, which one slow step (a collection, a
log interval's sync, a stall of a shared host) does not move; a close call is timed longer, and a level far from the
bar gets a second window, the faster of the two counting (a slow stretch does not last two windows). A level is kept
as the best so far when it is faster than the best before it (eager training to start with) by :data:`MARGIN`.

The eager reference comes from steady eager steps that record nothing (:data:`REFERENCE_STEPS` right before the
first capture): warmup steps record every target call, which makes them slower than eager training. Once settled,
the level's steady-state step time is checked once over :data:`CHECK_STEPS` steps against eager steps run between
them (the reference where a driver cannot run those); a level that lost goes back to eager training, with the
reason: the fit never stays on a level slower than eager.

The walk: the narrowest level first (it confirms that graphs work on the model at all), then from the widest level
down, until one is kept. Every level tried costs a capture and a few steps on slower graphs, and a wider level
holds the work of the narrower ones in fewer launches: once a level is confirmed faster, the narrower ones left
are skipped (their rows say so). A level that fails (a shape that never settles, capture, confirmation, memory budget)
or does not pay hands over to the next level of the walk, the first level included; when no level is left, training
settles on the best level tried (captured again if needed), or on eager training.

The eager baseline and the best time live here; the report's ``eager_step_ms`` and ladder rows only mirror them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_cudagraph._options.levels import Level, walk_order
from lightning_cudagraph.health import CUDAGraphReport, LevelRecord

__all__ = [
    "CHECK_EAGER_EVERY",
    "CHECK_STEPS",
    "EAGER",
    "FAR",
    "MARGIN",
    "MAX_MEASURE_STEPS",
    "MEASURE_STEPS",
    "REFERENCE_STEPS",
    "Ladder",
    "reference_steps",
]

#: A wider level is kept only if its median step time is this much below the best so far. Medians of a few replayed
#: steps on the H200 scatter by 1-4% for scoped graphs; 5% stays above that noise, so a level is never kept for a
#: gain that is not there, and costs at most 5% against the best level when two levels are that close.
MARGIN = 0.05
#: Steps timed per level once its graphs are confirmed (confirming steps run parity checks): their median decides
#: when it is clear of the margin by a margin (five: two slow steps do not move it); a closer call is timed over up to
#: :data:`MAX_MEASURE_STEPS`.
MEASURE_STEPS = 5
MAX_MEASURE_STEPS = 11
#: A level whose median is this far from the bar (slower or faster, as a ratio) is timed over a second window.
FAR = 1.3
#: Eager steps timed for the reference right before the first capture, recording nothing (``scope="auto"``).
REFERENCE_STEPS = 5
#: Steps on the settled level timed once more against eager training, with one eager step in every
#: :data:`CHECK_EAGER_EVERY` (the step after an eager one is not timed): both measured in the same stretch of the fit.
CHECK_STEPS = 6
CHECK_EAGER_EVERY = 4
#: Where the ladder settles when no level was faster than eager training by the margin (or none was confirmed).
EAGER = Level("eager", unavailable="no level was confirmed faster than eager training")


def reference_steps(batches_left: float, accumulate: int, confirm_steps: int) -> int:
    """The eager reference steps a fit has room for: :data:`REFERENCE_STEPS`, or none in a short fit.

    A fit too short to run the reference steps and still confirm and time its first level spends no steps on them:
    graphs come first, and the warmup steps give the eager baseline (a median of steps that also record).

    Args:
        batches_left: Training batches after the warmup steps (``inf`` when the fit's length is not known).
        accumulate: ``accumulate_grad_batches`` (the level's steps count optimizer steps).
        confirm_steps: The confirming steps of a first capture.

    Example:
        >>> reference_steps(float("inf"), 1, 2), reference_steps(40, 1, 2), reference_steps(8, 1, 2)
        (5, 5, 0)
    """
    needed = REFERENCE_STEPS + (confirm_steps + MEASURE_STEPS) * accumulate
    return REFERENCE_STEPS if batches_left >= needed else 0


class Ladder:
    """The levels of one fit and the decisions of their walk.

    Args:
        levels: From :func:`~lightning_cudagraph._rollout.preflight.plan`, skipped ones included.
        report: Its ``ladder`` rows, ``level`` and ``eager_step_ms`` mirror this ladder (written, never read).
        climbs: Whether the levels are walked and timed (``scope="auto"``); ``False``: a fixed scope's one level.
        margin: See :data:`MARGIN`.

    Example:
        >>> from lightning_cudagraph.health import CUDAGraphReport
        >>> report = CUDAGraphReport()
        >>> ladder = Ladder([Level("attn"), Level("layer")], report)
        >>> ladder.eager_ms = 20.0
        >>> ladder.measured(10.0).name  # attn pays: keep it as the best, try layer
        'layer'
        >>> ladder.measured(9.9).name  # layer is within the margin: back to attn
        'attn'
        >>> [(row.level, row.status) for row in report.ladder], ladder.best_ms
        ([('attn', 'kept'), ('layer', 'slower')], 10.0)
    """

    def __init__(
        self, levels: Sequence[Level], report: CUDAGraphReport, climbs: bool = True, margin: float = MARGIN
    ) -> None:
        self.report, self.climbs, self.margin = report, climbs, margin
        self._levels = [level for level in levels if level.unavailable is None]
        self._rows = {level.name: LevelRecord(level.name) for level in self._levels} if climbs else {}
        #: The report's ladder rows, in climbing order (none for a fixed scope).
        self.rows = [
            self._rows.get(level.name) or LevelRecord(level.name, status="skipped", reason=level.unavailable)
            for level in levels
            if climbs
        ]
        report.ladder = self.rows
        self._walk = walk_order(self._levels)
        self._position = 0
        self._best: Level | None = None
        #: The median eager step time before the first capture (``nan`` until measured); the bar a level must pass.
        self.eager_ms = math.nan
        #: The best level's median step time (``nan`` while no level was kept).
        self.best_ms = math.nan
        #: Eager training's median in the steady-state check (``nan`` until then).
        self.steady_eager_ms = math.nan
        self._regions: dict[str, frozenset[str]] = {}
        self.settled = not self._levels or not climbs

    @property
    def current(self) -> Level | None:
        """The level training is on (or going to)."""
        return self._walk[self._position] if self._walk else None

    @property
    def to_try(self) -> list[Level]:
        """The levels the walk may try, in the order it tries them (it stops at the first one kept after the first)."""
        return list(self._walk)

    @property
    def row(self) -> LevelRecord:
        """The report's row of the current level."""
        return self._rows[self._walk[self._position].name]

    def skip(self, name: str, reason: str) -> None:
        """Take a level out before the walk starts (a problem found once the optimizers exist)."""
        self._levels = [level for level in self._levels if level.name != name]
        self._walk = walk_order(self._levels)
        row = self._rows.pop(name, None)
        if row is not None:
            row.status, row.reason = "skipped", reason
        self.settled = self.settled or not self._levels

    def close_call(self, step_ms: float, spread: float = 1.0) -> bool:
        """Whether ``step_ms`` is too near the bar a level must pass to decide on a few steps (time it longer).

        Near means within the margin of the bar, or within half the steps' spread (``max / min``) of it: a median
        of noisy steps is only that sure.
        """
        bar = self._reference() * (1 - self.margin)
        return not math.isnan(bar) and abs(step_ms - bar) < max(bar * self.margin, step_ms * (spread - 1) / 2)

    def far(self, step_ms: float) -> bool:
        """Whether ``step_ms`` is so far from the bar (by :data:`FAR`, either way) that a second window confirms it."""
        bar = self._reference() * (1 - self.margin)
        return not math.isnan(bar) and bar > 0 and not 1 / FAR < step_ms / bar < FAR

    def checked(self, step_ms: float, eager_ms: float = math.nan) -> bool:
        """The settled level's steady-state time against eager steps timed beside it (``nan``: the reference).

        Returns whether it still beats eager training; else its row says it lost, and no level is kept.
        """
        self.steady_eager_ms = self.eager_ms if math.isnan(eager_ms) else eager_ms
        if self._best is None or math.isnan(self.steady_eager_ms) or step_ms < self.steady_eager_ms:
            return True
        row = self._rows[self._best.name]
        row.status = "slower"
        row.reason = (
            f"{step_ms:.2f} ms/step in the steady state, not faster than eager training ({self.steady_eager_ms:.2f})"
        )
        self._best, self.best_ms = None, math.nan
        self.report.level = None
        return False

    def same_regions(self, regions: frozenset[str] | None) -> str | None:
        """The current level captures ``regions``: a level timed before that captured the same ones, or ``None``.

        Layers narrowed to their parts can make two levels capture the same regions; the second is not timed again.
        ``None`` (the whole step) matches nothing.
        """
        if regions is None:
            return None
        name = self._walk[self._position].name
        self._regions[name] = regions
        return next((other for other, seen in self._regions.items() if seen == regions and other != name), None)

    def same_as(self, other: str) -> Level | None:
        """The current level ended up capturing the regions ``other`` did: where to go (as :meth:`measured`)."""
        row = self.row
        row.status, row.reason = "skipped", f"after narrowing, the same regions as {other!r}"
        return self._next()

    def measured(self, step_ms: float) -> Level | None:
        """The current level is confirmed and timed: the level to move to next, ``None`` to stay, or :data:`EAGER`."""
        row = self.row
        row.step_ms = step_ms
        reference = self._reference()
        if math.isnan(reference) or step_ms < reference * (1 - self.margin):
            if self._best is not None:
                self._rows[self._best.name].status = "slower"
            self._best, self.best_ms = self.current, step_ms
            row.status = "kept"
        else:
            row.status = "slower"
        return self._next()

    def _reference(self) -> float:
        """The time to beat: the best level's, or eager training's while none was kept."""
        return self.best_ms if self._best is not None else self.eager_ms

    def _next(self) -> Level | None:
        best = self._best
        if self._position > 0 and best is not None and best is self.current:  # narrower levels hold less of its work
            for level in self._walk[self._position + 1 :]:
                row = self._rows[level.name]
                row.status, row.reason = "skipped", f"{best.name!r} was confirmed faster and holds its work"
            return self._settle()
        if self._position + 1 < len(self._walk):
            self._position += 1
            return self.current
        return self._settle()

    def failed(self, reason: str) -> Level | None:
        """The current level failed: where the walk goes next.

        A failure does not end the climb: what failed one level (a shape that never settles, a capture that fails)
        may not touch the levels above or below it, the whole step included.

        Returns:
            The next level of the walk (after the first, the widest; then narrower ones); with none left, the best
            level confirmed to go back to (``None`` if it is the current one) or :data:`EAGER`.
        """
        row = self.row
        row.status, row.reason = "failed", reason
        if self._position + 1 < len(self._walk):
            self._position += 1
            return self.current
        return self._settle()

    def step_down(self, reason: str) -> Level | None:
        """The settled whole step failed for a reason the other levels do not have: the widest of them, settled on.

        Its time is checked once more against eager training (as any level settled on is). ``None``: no level left.
        """
        row = self.row
        row.status, row.reason = "failed", reason
        below = [level for level in self._walk[self._position + 1 :] if not level.whole_step]
        if not below:
            return None
        level = below[0]
        self._best, self.best_ms = level, self._rows[level.name].step_ms
        self._position = self._walk.index(level)
        self._rows[level.name].status = "kept"
        self._rows[level.name].reason = "the whole step could no longer hold the step's Python"
        self.report.level = level.name
        return level

    def _settle(self) -> Level | None:
        self.settled = True
        if self._best is None:
            self.report.level = None
            return EAGER
        self.report.level = self._best.name
        if self._best is self.current:
            return None
        self._position = self._walk.index(self._best)
        return self._best

    def describe(self) -> str:
        """One part per row: what each level measured and became."""
        parts = []
        for row in self.rows:
            timing = f" {row.step_ms:.2f} ms" if not math.isnan(row.step_ms) else ""
            why = f" ({row.reason})" if row.reason else ""
            parts.append(f"{row.level}: {row.status}{timing}{why}")
        return "; ".join(parts)
