"""Where a level's failure sends the ladder: another level, or nowhere (the failure becomes a rollback).

While ``scope="auto"`` climbs, a failed level hands over to the next level of the walk, or back to the fastest level
confirmed before it. Settled on the whole step, a step whose Python changed (an epoch, a callback) goes down to the
widest level that runs that Python, checked against eager training there. A fixed scope has nowhere to go.
"""

from __future__ import annotations

from lightning_cudagraph._options.levels import Level
from lightning_cudagraph._rollout.ladder import EAGER, Ladder
from lightning_cudagraph._warnings import warn_user

__all__ = ["PYTHON_REASONS", "after_failure"]

#: Failures of a settled whole step that a level running the step's Python every step does not have.
PYTHON_REASONS = ("step_python", "skipped_step")


def after_failure(ladder: Ladder, reason: str, component: str) -> Level | None:
    """The level the ladder goes to after its current level failed for ``reason``, with a warning; ``None``: none."""
    if ladder.settled:
        return _step_down(ladder, reason, component)
    failed = ladder.row.level
    level = ladder.failed(reason)
    if level is EAGER or level is None:
        return None
    where = (
        f"goes back to {level.name!r}, the fastest level confirmed before it"
        if ladder.settled
        else f"tries {level.name!r} next"
    )
    warn_user(f"{component}: level {failed!r} of scope='auto' failed ({reason}); training {where}")
    return level


def _step_down(ladder: Ladder, reason: str, component: str) -> Level | None:
    """The settled whole step can no longer hold the step's Python: settle on the widest level below it."""
    current = ladder.current
    if not ladder.climbs or current is None or not current.whole_step or not reason.startswith(PYTHON_REASONS):
        return None  # a fixed scope has no level to go to
    level = ladder.step_down(reason)
    if level is None:
        return None
    warn_user(
        f"{component}: the whole step of scope='auto' can no longer hold the step's Python ({reason});"
        f" training goes down to {level.name!r}"
    )
    return level
