"""The walk of ``scope="auto"`` 's ladder during a fit: switch levels, time each one, move on or go back.

:class:`~lightning_cudagraph.ladder.Ladder` decides; :class:`Climb` carries the decisions out between training
steps. A level is timed over its first steps on graphs with the backend's timer: CUDA events, read once per
decision, so no host sync per step; a step's time runs from the end of the step before, Lightning's work between
steps included. Every move happens at the end of a training batch, so the next step starts on the new level: a
scoped level captures at once from the samples recorded during warmup; the whole step runs one eager step with its
capturable optimizer first (NCCL's eager steps first under DDP).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_cudagraph.config import FULL_ITERATION
from lightning_cudagraph.drivers.base import Driver
from lightning_cudagraph.drivers.scoped import ScopedDriver
from lightning_cudagraph.graphs.backend import CaptureBackend
from lightning_cudagraph.health import CUDAGraphReport, Stage
from lightning_cudagraph.ladder import EAGER, MAX_MEASURE_STEPS, MEASURE_STEPS, Ladder, Rung
from lightning_cudagraph.preflight import DDP_FULL_ITERATION_MIN_WARMUP
from lightning_cudagraph.scopes import Target
from lightning_cudagraph.stages import StageMachine
from lightning_cudagraph.timing import StepTimer, median


class Climb:
    """Walks the ladder of one fit.

    Args:
        rungs: From :func:`~lightning_cudagraph.ladder.build_rungs`.
        report: The ladder's rows, the level and the timings are written here.
        component: Named in messages.
    """

    def __init__(self, rungs: Sequence[Rung], report: CUDAGraphReport, component: str) -> None:
        self.ladder = Ladder(rungs, report)
        self.report, self.component = report, component
        #: The driver of the level training is on (``None`` until :meth:`attach`).
        self.driver: Driver | None = None
        self._make_driver: Callable[[bool, list[str]], Driver] | None = None
        self._machine: StageMachine | None = None
        self._backend: CaptureBackend | None = None
        self._trainer: pl.Trainer | None = None
        self._window = StepTimer(use_cuda=False)
        self._timing = False
        self._measured = 0
        self._due = MEASURE_STEPS
        self._times: list[float] = []
        self._regions_of: dict[str, frozenset[str]] = {}
        self._since_capture = 0
        self._pending: Rung | None = None
        self._driver_released = False
        self._capture_mark = 0.0

    @property
    def rungs(self) -> list[Rung]:
        """The rungs to try, in order."""
        return self.ladder.to_try

    @property
    def scoped_targets(self) -> list[Target]:
        """Every target of every scoped rung (all are patched for the fit)."""
        return self.ladder.scoped_targets

    def check_full_step(self, problem: str | None) -> None:
        """Skip the whole-step rung when the optimizers rule it out."""
        if problem is not None:
            self.ladder.skip(FULL_ITERATION, problem)

    def attach(
        self,
        trainer: pl.Trainer,
        backend: CaptureBackend,
        machine: StageMachine,
        make_driver: Callable[[bool, list[str]], Driver],
    ) -> None:
        """Start on the first rung: its driver runs the warmup steps, recording every scoped rung's targets.

        Args:
            trainer: The Trainer of the fit.
            backend: Gives the timer and a new pool for each level.
            machine: The stage machine; a level's failure is offered to the climb before it becomes a rollback.
            make_driver: Builds a driver for the whole step (``True``) or for the named scoped targets.
        """
        self._trainer, self._backend, self._machine, self._make_driver = trainer, backend, machine, make_driver
        self._window = backend.timer()
        machine.on_level_failure = self._level_failed
        rung = self.ladder.current
        self.driver = make_driver(rung.full_step, _names(rung))
        self._enter(rung)

    # ------------------------------------------------------------------ per step (no host sync)
    def step_started(self) -> None:
        """Note whether this step counts towards the level's time.

        It does when it replays the level's graphs once they are confirmed: confirming steps also run the parity
        checks' eager forwards, which would make a level look slower (and its timing noisier) than it is.
        """
        self._timing = (
            self._machine is not None
            and not self.ladder.settled
            and self._pending is None
            and self._since_capture >= 1
            and self._machine.stage == Stage.REPLAYING
        )

    def step_ended(self) -> None:
        """Count the step towards its level.

        A timed step's time runs from the previous step's end to its own, so Lightning's work between steps counts
        as it does in training.
        """
        if self.ladder.settled or self._machine is None:
            return
        self.ladder.row.steps += 1
        on_graphs = self._machine.stage in (Stage.CONFIRMING, Stage.REPLAYING)
        self._since_capture += on_graphs
        if self._timing:
            self._window.stop()
            self._measured += 1
        if on_graphs and self._since_capture >= 1:
            self._window.start()

    def move_if_due(self) -> None:
        """At the end of a batch: go where a failure sent the ladder, or decide once the level is confirmed, timed."""
        if self._machine is None:
            return
        machine = self._machine
        if self._pending is not None:
            rung, self._pending = self._pending, None
            self._switch(rung)
        elif not self.ladder.settled and self._measured >= self._due and machine.stage == Stage.REPLAYING:
            self._time_or_decide()

    # ------------------------------------------------------------------ decisions
    def _time_or_decide(self) -> None:
        """Decide on the steps timed so far (one host sync), or time a close call over a few more steps."""
        same = self._same_regions_as()
        if same is not None:
            self._measured, self._times = 0, []
            self._note_capture_time()
            self._follow(self.ladder.same_as(same))
            return
        self._times.extend(self._window.read())
        spread = max(self._times) / max(min(self._times), 1e-9)
        step_ms, spread = self._machine.agreement.slowest(median(self._times), spread)
        unsure = self.ladder.close_call(step_ms, self.report.eager_step_ms, spread)
        if len(self._times) < MAX_MEASURE_STEPS and unsure:
            self._due = MAX_MEASURE_STEPS
            return
        self._decide(step_ms)

    def _same_regions_as(self) -> str | None:
        """A rung timed before whose regions the current one captures too (``None`` if none, or not scoped)."""
        driver = self.driver
        if not isinstance(driver, ScopedDriver) or self._times:
            return None
        regions = frozenset(target.name for target in driver.regions.active_targets)
        self._regions_of[self.ladder.current.name] = regions
        return next(
            (name for name, seen in self._regions_of.items() if seen == regions and name != self.ladder.current.name),
            None,
        )

    def _decide(self, step_ms: float) -> None:
        self._measured, self._times = 0, []
        self._note_capture_time()
        self._follow(self.ladder.measured(step_ms, self.report.eager_step_ms))

    def _follow(self, rung: Rung | None) -> None:
        """Carry out where the ladder says to go: nowhere (settled here), eager training, or another rung."""
        machine = self._machine
        if rung is EAGER:
            machine.disable(
                "not_faster",
                detail=f"no level of scope='auto' was faster than eager training ({self.report.eager_step_ms:.2f}"
                f" ms/step) by the margin: {self.ladder.describe()}; training goes on eagerly",
            )
        elif rung is None:
            self._settled()
        else:
            self._switch(rung)

    def _level_failed(self, reason: str) -> bool:
        """A level failed while climbing: try the next level, or go back to the best one confirmed (``False``: none)."""
        if self.ladder.settled or self._machine is None:
            return False
        failed = self.ladder.current.name
        self._note_capture_time()
        rung = self.ladder.failed(reason)
        if rung is EAGER or rung is None:
            return False
        where = (
            f"goes back to {rung.name!r}, the fastest level confirmed before it"
            if self.ladder.settled
            else f"tries {rung.name!r} next"
        )
        rank_zero_warn(f"{self.component}: level {failed!r} of scope='auto' failed ({reason}); training {where}")
        self.driver.release()
        self._driver_released = True
        self._pending = rung
        return True

    # ------------------------------------------------------------------ moving
    def _switch(self, rung: Rung) -> None:
        trainer, driver = self._trainer, self.driver
        if not rung.full_step and isinstance(driver, ScopedDriver) and not self._driver_released:
            driver.capture_level(_names(rung))
        else:
            driver.release()
            self.driver = self._make_driver(rung.full_step, _names(rung))
            self.driver.take_seal_from(driver)
            self.driver.first_eager_steps = self._eager_steps_before(rung, trainer)
            self.driver.start(trainer)

        self._backend.renew_pool()
        self._machine.begin_level()
        self._enter(rung)

    def _enter(self, rung: Rung) -> None:
        self._measured, self._since_capture, self._timing, self._driver_released = 0, 0, False, False
        self._times, self._due = [], MEASURE_STEPS
        self._window.read()  # drop a partial window
        self._capture_mark = self.report.capture_ms_total
        self.report.level = rung.name
        self.driver.measure_pool = self.ladder.settled  # the allocator snapshot once, for the level kept
        if not self.ladder.settled:
            self.ladder.row.status = "trying"
        if isinstance(self.driver, ScopedDriver):
            self.driver.keep_samples = not self.ladder.settled
            self.driver.warmup_iters = 1  # the regions already ran on this stream in every step so far
        if self.ladder.settled:
            rank_zero_info(f"{self.component}: scope='auto' goes back to {rung.name!r}: {self.ladder.describe()}")

    def _settled(self) -> None:
        driver = self.driver
        if isinstance(driver, ScopedDriver):
            driver.forget_samples()
        driver.measure_pool = True
        self.report.pool_mib = self._backend.pool_mib()
        rank_zero_info(f"{self.component}: scope='auto' settled on {self.report.level!r}: {self.ladder.describe()}")

    def _note_capture_time(self) -> None:
        row = self.ladder.row
        row.capture_ms += self.report.capture_ms_total - self._capture_mark
        self._capture_mark = self.report.capture_ms_total

    def _eager_steps_before(self, rung: Rung, trainer: pl.Trainer) -> int:
        """Eager steps before a new driver's capture.

        One: the recording step of scoped regions, or the first step of the optimizers in the capturable form the
        whole step switches them to (under DDP, as many as NCCL still needs). Optimizers stay as built below the
        whole step: a capturable optimizer steps slower eagerly.
        """
        if rung.full_step and isinstance(trainer.strategy, DDPStrategy):
            return max(1, DDP_FULL_ITERATION_MIN_WARMUP - trainer.global_step)
        return 1

    def release(self) -> None:
        """The fit ends: nothing pending."""
        self._pending = None


def _names(rung: Rung) -> list[str]:
    return [target.name for target in rung.targets]
