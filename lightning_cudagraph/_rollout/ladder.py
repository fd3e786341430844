"""The decisions of the ladder: which level is on, which was best, where to go next. Pure bookkeeping.

A fixed scope is a one-level ladder: settled from the start, untimed, with no rows in the report. Under
``scope="auto"`` the walk tries the narrowest level first (it confirms that graphs work on the model at all), then the
widest down: every level tried costs a capture and steps on slower graphs, so once a level is confirmed faster, the
narrower ones (whose work it holds in fewer launches) are skipped. A level that fails or does not pay hands over to
the next; with none left, training settles on the best level tried, or on eager training. The eager baseline and the
best time live here; the report only mirrors them.
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

#: A level is kept only if its median step time is this much below the best so far (eager training to start with):
#: medians of a few replayed steps on the H200 scatter by 1-4% for scoped graphs.
MARGIN = 0.05
#: Steps timed per level once its graphs are confirmed (confirming steps run parity checks). Their median decides a
#: clear call (two slow steps do not move it); a close call is timed over up to :data:`MAX_MEASURE_STEPS`.
MEASURE_STEPS = 5
MAX_MEASURE_STEPS = 11
#: A level whose median is this far from the bar (slower or faster, as a ratio) is timed over a second window.
FAR = 1.3
#: Eager steps timed for the reference right before the first capture: they record nothing, unlike warmup steps,
#: which record every target call and run slower than eager training.
REFERENCE_STEPS = 5
#: Steps on the settled level timed once more against eager training, one eager step in every
#: :data:`CHECK_EAGER_EVERY` (the step after it is not timed): the fit never stays on a level slower than eager.
CHECK_STEPS = 6
CHECK_EAGER_EVERY = 4
#: Where the ladder settles when no level was faster than eager training by the margin (or none was confirmed).
EAGER = Level("eager", unavailable="no level was confirmed faster than eager training")


def reference_steps(batches_left: float, accumulate: int, confirm_steps: int) -> int:
    """The eager reference steps a fit has room for: :data:`REFERENCE_STEPS`, or none in a short fit.

    A fit with too few ``batches_left`` after its warmup steps (``inf``: not known) to run them and still confirm and
    time its first level runs none: the warmup steps give the eager baseline instead.

    Example:
        >>> reference_steps(float("inf"), 1, 2), reference_steps(40, 1, 2), reference_steps(8, 1, 2)
        (5, 5, 0)
    """
    needed = REFERENCE_STEPS + (confirm_steps + MEASURE_STEPS) * accumulate
    return REFERENCE_STEPS if batches_left >= needed else 0


class Ladder:
    """The levels of one fit and the decisions of their walk.

    ``levels`` include the skipped ones; ``report`` mirrors the ladder (written, never read); ``climbs`` is
    ``scope="auto"`` (the levels are walked and timed), else a fixed scope's one level.

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

    def __init__(self, levels: Sequence[Level], report: CUDAGraphReport, climbs: bool = True) -> None:
        self.report, self.climbs = report, climbs
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

        Near means within the margin, or within half the steps' spread (``max / min``): a median of noisy steps is
        only that sure.
        """
        bar = self._bar()
        return not math.isnan(bar) and abs(step_ms - bar) < max(bar * MARGIN, step_ms * (spread - 1) / 2)

    def far(self, step_ms: float) -> bool:
        """Whether ``step_ms`` is so far from the bar (by :data:`FAR`, either way) that a second window confirms it."""
        bar = self._bar()
        return not math.isnan(bar) and bar > 0 and not 1 / FAR < step_ms / bar < FAR

    def checked(self, step_ms: float, eager_ms: float = math.nan) -> bool:
        """Whether the settled level beats eager steps timed beside it (``nan``: the reference); else none is kept."""
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
        """The current level captures ``regions`` (``None``: the whole step): a level timed before on the same ones.

        Layers narrowed to their parts can make two levels capture the same regions; the second is not timed again.
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
        bar = self._bar()
        if math.isnan(bar) or step_ms < bar:
            if self._best is not None:
                self._rows[self._best.name].status = "slower"
            self._best, self.best_ms = self.current, step_ms
            row.status = "kept"
        else:
            row.status = "slower"
        return self._next()

    def _bar(self) -> float:
        """The time to beat by the margin: the best level's, or eager training's while none was kept."""
        return (self.best_ms if self._best is not None else self.eager_ms) * (1 - MARGIN)

    def _next(self) -> Level | None:
        best = self._best
        if self._position > 0 and best is not None and best is self.current:  # narrower levels hold less of its work
            for level in self._walk[self._position + 1 :]:
                row = self._rows[level.name]
                row.status, row.reason = "skipped", f"{best.name!r} was confirmed faster and holds its work"
            return self._settle()
        return self._advance()

    def _advance(self) -> Level | None:
        if self._position + 1 < len(self._walk):
            self._position += 1
            return self.current
        return self._settle()

    def failed(self, reason: str) -> Level | None:
        """The current level failed: the next level of the walk, or (none left) where it settles (as :meth:`measured`).

        What failed one level (a shape that never settles, a capture) may not touch the others, the whole step included.
        """
        row = self.row
        row.status, row.reason = "failed", reason
        return self._advance()

    def step_down(self, reason: str) -> Level | None:
        """The settled whole step failed for a reason the other levels do not have: the widest of them (``None``: none).

        It is settled on, and checked against eager training as any level settled on is.
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
