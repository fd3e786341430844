"""The decisions of the ladder: which level is on, which was best, where to go next. Pure bookkeeping.

A fixed scope is a one-level ladder: settled from the start, untimed, with no rows in the report. Under
``scope="auto"`` each level is captured, confirmed like any graph, then timed over :data:`MEASURE_STEPS` steps on
its graphs (CUDA events read once per decision; a close call is timed longer). A level is kept as the best so far
when it is faster than the best before it (eager training to start with) by :data:`MARGIN`.

The walk: the narrowest level first (it confirms that graphs work on the model at all), then from the widest level
down, until one is kept. Every level tried costs a capture and a few steps on slower graphs, and a wider level
holds the work of the narrower ones in fewer launches: once a level is confirmed faster, the narrower ones left
are skipped (their rows say so). A level that fails (capture, confirmation, memory budget) or does not pay hands
over to the next narrower one. If the first level fails, the rollout rolls back to eager as a fixed scope would;
when no level is left, training settles on the best level tried (captured again if needed), or on eager training.

The eager baseline and the best time live here; the report's ``eager_step_ms`` and ladder rows only mirror them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_cudagraph.health import CUDAGraphReport, LevelRecord
from lightning_cudagraph.levels import Level, walk_order

__all__ = ["EAGER", "MARGIN", "MAX_MEASURE_STEPS", "MEASURE_STEPS", "Ladder"]

#: A wider level is kept only if its median step time is this much below the best so far. Medians of a few replayed
#: steps on the H200 scatter by 1-4% for scoped graphs; 5% stays above that noise, so a level is never kept for a
#: gain that is not there, and costs at most 5% against the best level when two levels are that close.
MARGIN = 0.05
#: Steps timed per level once its graphs are confirmed (confirming steps run parity checks): their median decides
#: when it is clear of the margin by a margin; a closer call is timed over up to :data:`MAX_MEASURE_STEPS`.
MEASURE_STEPS = 2
MAX_MEASURE_STEPS = 8
#: Where the ladder settles when no level was faster than eager training by the margin (or none was confirmed).
EAGER = Level("eager", unavailable="no level was confirmed faster than eager training")


class Ladder:
    """The levels of one fit and the decisions of their walk.

    Args:
        levels: From :func:`~lightning_cudagraph.preflight.plan`, skipped ones included.
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

        Returns:
            The next narrower level to try; with none left, or when the first level failed, the best level
            confirmed to go back to (``None`` if it is the current one) or :data:`EAGER`.
        """
        row = self.row
        row.status, row.reason = "failed", reason
        if 0 < self._position < len(self._walk) - 1:
            self._position += 1
            return self.current
        return self._settle()

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
