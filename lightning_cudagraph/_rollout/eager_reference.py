"""The eager reference of ``scope="auto"``: steady eager steps that record nothing, timed as a level's steps are.

They give the eager baseline right before the first capture, and run between the settled level's replays in its
steady-state check. The driver runs one where it could when :meth:`EagerReference.take_step` (its
``Driver.take_reference_step``) says so.
"""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_cudagraph._backend.timing import StepTimer
from lightning_cudagraph._graphs.base import Driver
from lightning_cudagraph._rollout.ladder import CHECK_EAGER_EVERY, REFERENCE_STEPS, reference_steps
from lightning_cudagraph.health import Stage

__all__ = ["EagerReference"]


class EagerReference:
    """The eager reference steps of one walked ladder (none for a fixed scope): how many are left, and their timer."""

    def __init__(self) -> None:
        self._timer: StepTimer | None = None  # times the reference steps while there are any to time
        #: Whether the settled level's steady-state check is under way.
        self.checking = False
        self._check_steps = 0
        self._left = 0  # reference steps the driver of the level is to run yet

    def driver_built(self, driver: Driver) -> None:
        """The level runner built ``driver``: it asks :meth:`take_step`, with none left (a new driver runs none yet)."""
        driver.take_reference_step, self._left = self.take_step, 0

    def take_step(self) -> bool:
        """Asked by the driver where it could run a reference step: whether it runs one now (one fewer left if so)."""
        if self._left <= 0:
            return False
        self._left -= 1
        return True

    def before_first_capture(self, timer: StepTimer) -> None:
        """The ladder walks: the driver runs the reference steps right before its first capture."""
        self._left, self._timer = REFERENCE_STEPS, timer

    def fit_length_known(self, trainer: pl.Trainer, first_eager_steps: int, confirm_steps: int) -> None:
        """Training starts (its length is known now): a short fit runs no reference steps."""
        if self._timer is None:
            return
        total = float(trainer.estimated_stepping_batches) * trainer.accumulate_grad_batches
        left = total - first_eager_steps * trainer.accumulate_grad_batches
        self._left = reference_steps(left, trainer.accumulate_grad_batches, confirm_steps)

    def batch_started(self, stage: Stage) -> None:
        """During the steady-state check, one step in :data:`CHECK_EAGER_EVERY` of the replaying level runs eagerly."""
        if self.checking:
            self._check_steps += 1
            if self._check_steps % CHECK_EAGER_EVERY == 1 and stage == Stage.REPLAYING:
                self._left = 1  # this step runs eagerly, timed against the level's steps around it

    def batch_ended(self, driver: Driver) -> None:
        """A reference step runs from the end of the step before to its own end, as a level's steps are timed."""
        if self._timer is None:
            return
        if driver.in_reference_step:
            self._timer.stop()
        if self._left > 0 or self.checking:
            self._timer.start()

    def baseline(self) -> list[float] | None:
        """Right before a capture: the times of the reference steps so far (``None``: none timed); timing stops."""
        times = self._timer.read() if self._timer is not None else None
        self._timer = None
        return times

    def begin_check(self, timer: StepTimer) -> None:
        """The settled level is timed once more: time eager steps between its replays."""
        self.checking, self._check_steps, self._timer = True, 0, timer

    def end_check(self) -> list[float]:
        """The steady-state check ends: no more reference steps; the eager steps' times (none, if none ran)."""
        self.checking, self._left = False, 0
        return self.baseline() or []
