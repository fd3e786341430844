"""The decisions of the ladder: which level is on, which was best, where to go next. Pure bookkeeping.

A fixed scope is a one-level ladder: settled from the start, untimed, with no rows in the report. Under
``scope="auto"`` the walk tries the widest level that preflight did not refuse first (the whole step, where a strategy
owns it), then each narrower one, only while the levels before it failed or were not faster than eager training by the
margin. Every level tried costs a capture and steps on slower graphs, and a wider level holds the work of the narrower
ones in fewer launches: so the first level confirmed faster is settled on, the narrower ones are skipped, and a near
tie goes to the wider level. With no level left, training settles on eager training. The eager baseline and the best
time live here; the report only mirrors them.
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

#: A level is kept only if its median step time is this much below eager training's, or below the level kept before
#: it, if any (a narrower level does not replace a wider one on a near tie): medians of a few replayed steps on the
#: H200 scatter by 1-4% for scoped graphs.
MARGIN = 0.05
#: Steps timed per level once its graphs are confirmed (confirming steps run parity checks). Their median decides a
#: clear call (two slow steps do not move it); a close call is timed over up to :data:`MAX_MEASURE_STEPS`.
MEASURE_STEPS = 5
MAX_MEASURE_STEPS = 11
#: A level whose median is this far above the bar (as a ratio) is timed over a second window: a slow stretch of the
#: host does not last two windows. A median this far below it is decided at once, as is any clear call: noise only
#: slows steps, and the steady-state check times the level kept against eager training anyway.
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
        >>> ladder.current.name  # the widest level goes first
        'layer'
        >>> ladder.measured(19.5).name  # not faster than eager training by the margin: the next narrower level
        'attn'
        >>> ladder.measured(10.0) is None, ladder.settled  # attn pays, and training is on it: stay
        (True, True)
        >>> [(row.level, row.status) for row in report.ladder], ladder.best_ms
        ([('attn', 'kept'), ('layer', 'slower')], 10.0)

        The first level kept is settled on; the narrower ones hold less of its work and are not tried:

        >>> wide = Ladder([Level("attn"), Level("layer")], CUDAGraphReport())
        >>> wide.eager_ms = 20.0
        >>> wide.measured(10.0) is None, [(row.level, row.status) for row in wide.rows]
        (True, [('attn', 'skipped'), ('layer', 'kept')])
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
        #: Whether training is on :attr:`current` (a driver runs it); before, a level is left out with :meth:`skip`.
        self.started = False

    @property
    def current(self) -> Level | None:
        """The level training is on (or going to)."""
        return self._walk[self._position] if self._walk else None

    @property
    def to_try(self) -> list[Level]:
        """The levels the walk may try, in the order it tries them, widest first (it stops at the first one kept)."""
        return list(self._walk)

    @property
    def row(self) -> LevelRecord:
        """The report's row of the current level."""
        return self._rows[self._walk[self._position].name]

    def skip(self, name: str, reason: str) -> None:
        """Take a level out (a problem found once the optimizers exist, or one the step's Python showed later).

        Training stays on the level it is on: a level taken out before it moves the walk's position, not the level.
        """
        current = self.current
        self._levels = [level for level in self._levels if level.name != name]
        self._walk = walk_order(self._levels)
        if current is not None and current in self._walk:
            self._position = self._walk.index(current)
        else:  # the current level itself: its place goes to the next one
            self._position = min(self._position, max(len(self._walk) - 1, 0))
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

    def far_slower(self, step_ms: float) -> bool:
        """Whether ``step_ms`` is so far above the bar (by :data:`FAR`) that a second window is timed before a drop.

        A whole window slowed by the host (another process, clocks) would otherwise send the walk to a narrower level
        for good. A median far below the bar needs no second window: a slow stretch cannot make a level look faster.
        """
        bar = self._bar()
        return not math.isnan(bar) and bar > 0 and step_ms / bar >= FAR

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
        """The current level is confirmed and timed: the level to move to next, ``None`` to stay, or :data:`EAGER`.

        A level faster than the bar by the margin is kept, and the walk settles on it.
        """
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
        """The time to beat by the margin: eager training's while no level was kept, else the (wider) level kept."""
        return (self.best_ms if self._best is not None else self.eager_ms) * (1 - MARGIN)

    def _next(self) -> Level | None:
        best = self._best
        if best is not None and best is self.current:  # the first level kept: the narrower ones hold less of its work
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

        The walk settled on the whole step before timing any narrower level, so it goes on from that one as if the
        whole step had failed on its way: the level is tried, confirmed and timed against eager training, and the
        narrower ones follow while it fails or does not pay.
        """
        row = self.row
        row.status, row.reason = "failed", reason
        below = [level for level in self._walk[self._position + 1 :] if not level.whole_step]
        if not below:
            return None
        self._position = self._walk.index(below[0])
        for level in self._walk[self._position :]:  # skipped for the whole step, which no longer holds their work
            self._rows[level.name].status, self._rows[level.name].reason = "planned", None
        self._best, self.best_ms = None, math.nan
        self.settled = False
        self.report.level = None
        return below[0]

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
