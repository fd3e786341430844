"""The level runner: one runner drives every fit, a fixed scope's one level and ``scope="auto"`` 's ladder alike.

:class:`~lightning_cudagraph._rollout.ladder.Ladder` decides; :class:`Climb` carries the decisions out at the end of a
training batch, through the driver interface only: a scoped level captures at once from the recorded samples, the
whole step runs an eager step first (NCCL's under DDP).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph._backend.backend import CaptureBackend
from lightning_cudagraph._backend.timing import median
from lightning_cudagraph._graphs.base import Driver, LevelSettings
from lightning_cudagraph._options.levels import Level, Plan
from lightning_cudagraph._rollout.eager_reference import EagerReference
from lightning_cudagraph._rollout.factory import DriverFactory, IdleDriver
from lightning_cudagraph._rollout.ladder import CHECK_STEPS, EAGER, MAX_MEASURE_STEPS, MEASURE_STEPS, Ladder
from lightning_cudagraph._rollout.level_failure import after_failure
from lightning_cudagraph._rollout.preflight import eager_steps_before_whole_step
from lightning_cudagraph._rollout.step_times import FitSteps, LevelRun
from lightning_cudagraph._trust.stages import StageMachine
from lightning_cudagraph.health import CUDAGraphReport, Stage

__all__ = ["Climb", "RunningFit"]


@dataclass
class RunningFit:
    """What the runner works with once training can start (from :meth:`Climb.attach` on)."""

    trainer: pl.Trainer
    backend: CaptureBackend
    machine: StageMachine
    make_driver: DriverFactory
    steps: FitSteps
    level: LevelRun


class Climb:
    """Runs the ladder of one fit: its drivers, its step times, and the moves between levels (idle until attached).

    Args:
        plan: From :func:`~lightning_cudagraph._rollout.planning.plan`.
        report: The ladder's rows, the level and the timings are mirrored here.
        component: Named in messages.
        settings: A fixed scope's driver settings (:meth:`LevelSettings.of`); a walked ladder derives its own.
    """

    def __init__(self, plan: Plan, report: CUDAGraphReport, component: str, settings: LevelSettings) -> None:
        self.plan = plan
        self.ladder = Ladder(plan.levels, report, climbs=plan.climbs)
        self.report, self.component, self.settings = report, component, settings
        self._running: RunningFit | None = None
        #: The driver of the level training is on: an idle one (every hook does nothing) until :meth:`attach`.
        self.driver: Driver = IdleDriver()
        self._pending: Level | None = None  # where a failure sent the ladder (its driver is released)
        self.reference = EagerReference()

    @property
    def attached(self) -> bool:
        """Whether the runner drives the fit (from :meth:`attach` on)."""
        return self._running is not None

    @property
    def _fit(self) -> RunningFit:  # the moves and decisions come after attach
        if self._running is None:
            raise RuntimeError("the level runner moves between levels only once attached")
        return self._running

    def attach(self, trainer: pl.Trainer, backend: CaptureBackend, machine: StageMachine, make: DriverFactory) -> None:
        """Start on the first level: its driver runs the warmup steps (a scoped one records every scoped level's calls).

        The whole step, the widest level, goes first where it may be tried: it waits for the eager steps it needs
        (NCCL's under DDP), and its warmup steps record nothing: they give the eager baseline, no reference steps run.
        """
        level = self.ladder.current
        if level is None:
            raise RuntimeError("a ladder with no level to try has nothing to attach (the rollout turns graphs off)")
        steps, level_run = FitSteps(backend.timer(), self.report), LevelRun(backend.timer(), 0.0)
        # Held before the first driver is built: release frees the factory even when building that driver raised.
        self._running = RunningFit(trainer, backend, machine, make, steps, level_run)
        settings = self.settings
        if level.whole_step:
            eager_steps = max(settings.first_eager_steps, eager_steps_before_whole_step(trainer))
            settings = replace(settings, first_eager_steps=eager_steps)
        self.driver = make(level, _level_settings(self.ladder, settings), self._note_eager_baseline)
        self.reference.driver_built(self.driver)
        if not self.ladder.settled and not level.whole_step:  # warmup steps that record run slower than eager training
            self.reference.before_first_capture(backend.timer())
        machine.on_level_failure = self._level_failed
        self.ladder.started = True
        self._enter(level)

    def train_started(self, trainer: pl.Trainer, confirm_steps: int) -> None:
        """Training starts on the backend's stream, eagerly; its length is known now (a short one has no references)."""
        self._fit.backend.enter()
        self.driver.start(trainer)
        self.reference.fit_length_known(trainer, self.driver.settings.first_eager_steps, confirm_steps)

    # ------------------------------------------------------------------ per step (no host sync)
    def batch_started(self, trainer: pl.Trainer, batch: Any) -> None:
        """Hand the batch to the driver, start its timer, and note whether it counts towards the level's time."""
        fit = self._running
        if fit is None:
            return
        self.reference.batch_started(fit.machine.stage)
        self.driver.begin_batch(trainer, batch)
        fit.steps.timer.start()
        timing = (not self.ladder.settled or self.reference.checking) and self._pending is None
        fit.level.step_started(timing and fit.machine.stage == Stage.REPLAYING and not self.driver.in_reference_step)

    def batch_ended(self, outputs: Any) -> None:
        """Close the step: the driver's checks, then count it towards its level."""
        fit = self._running
        if fit is None:
            return
        fit.steps.timer.stop()
        self.driver.end_step(outputs)
        if fit.machine.stage == Stage.WARMUP:
            fit.machine.warmup_losses.observe(outputs)
        self.reference.batch_ended(self.driver)
        on_graphs = fit.machine.stage in (Stage.CONFIRMING, Stage.REPLAYING) and not self.driver.in_reference_step
        if not self.ladder.settled:
            self.ladder.row.steps += 1
        if not self.ladder.settled or self.reference.checking:
            fit.level.step_ended(on_graphs=on_graphs)

    def read_step_times(self) -> None:
        """Once per log interval: read the steps' times (one host sync); the report mirrors their median."""
        if self._running is not None:
            self._running.steps.read_interval(eager=self._running.machine.stage == Stage.WARMUP)

    def _note_eager_baseline(self) -> None:
        """Right before the first capture: the eager baseline (the slowest rank's), once; the report mirrors it."""
        eager = self._fit.steps.eager_median(self.reference.baseline())
        if eager is not None:
            (self.ladder.eager_ms,) = self._fit.machine.agreement.slowest(eager)
            self.report.eager_step_ms = self.ladder.eager_ms

    def move_if_due(self) -> None:
        """At the end of a batch: go where a failure sent the ladder, or decide once the level is confirmed, timed."""
        fit = self._running
        if fit is None:
            return
        due = fit.level.measured >= fit.level.due and fit.machine.stage == Stage.REPLAYING
        if self._pending is not None:
            level, self._pending = self._pending, None
            self._switch(level)
        elif not self.ladder.settled and due:
            self._time_or_decide()
        elif self.reference.checking and due:
            self._check_steady_state()

    # ------------------------------------------------------------------ decisions
    def _time_or_decide(self) -> None:
        """Decide on the steps timed so far (one host sync), or time a close or far slower call over more steps.

        A clear call, far faster than the bar included, is decided on the first window: only a level that might be
        dropped for a slow stretch or for noise near the bar is timed longer.
        """
        fit = self._fit
        run = fit.level
        same = self.ladder.same_regions(self.driver.captured_regions()) if not run.times else None
        if same is not None:
            self._note_capture_time()
            self._follow(self.ladder.same_as(same))
            return
        run.read()
        spread = max(run.times) / max(min(run.times), 1e-9)
        step_ms, spread = fit.machine.agreement.slowest(median(run.times), spread)
        if run.earlier:  # a slow stretch does not last two windows: the faster one counts
            step_ms = min(step_ms, *run.earlier)
        elif self.ladder.far_slower(step_ms):
            run.time_again(MEASURE_STEPS, step_ms)
            return
        if len(run.times) < MAX_MEASURE_STEPS and self.ladder.close_call(step_ms, spread):
            run.due = run.measured + MAX_MEASURE_STEPS - len(run.times)
            return
        self._note_capture_time()
        self._follow(self.ladder.measured(step_ms))

    def _check_steady_state(self) -> None:
        """Once, on the settled level: its steady-state median against the eager reference; eager if it lost."""
        fit = self._fit
        eager = self.reference.end_check()
        step_ms, eager_ms = fit.machine.agreement.slowest(median(fit.level.read()), median(eager))
        if not self.ladder.checked(step_ms, eager_ms):
            fit.machine.disable(
                "not_faster",
                detail=f"scope='auto' settled on a level that ran at {step_ms:.2f} ms/step in the steady state, not"
                f" faster than eager training ({self.ladder.steady_eager_ms:.2f} ms/step): {self.ladder.describe()};"
                " training goes on eagerly",
            )

    def _follow(self, level: Level | None) -> None:
        """Carry out where the ladder says to go: nowhere (settled here), eager training, or another level."""
        if level is EAGER:
            self._fit.machine.disable(
                "not_faster",
                detail=f"no level of scope='auto' was faster than eager training ({self.ladder.eager_ms:.2f}"
                f" ms/step) by the margin: {self.ladder.describe()}; training goes on eagerly",
            )
        elif level is None:
            self._settle()
        else:
            self._switch(level)

    def _level_failed(self, reason: str) -> bool:
        """A level failed: at the batch's end, go where :func:`after_failure` sends the ladder (``False``: nowhere)."""
        if not self.ladder.settled:
            self._note_capture_time()
        level = after_failure(self.ladder, reason, self.component)
        if level is None:
            return False
        self.driver.release()
        self._pending = level
        return True

    # ------------------------------------------------------------------ moving
    def _switch(self, level: Level) -> None:
        """Move to ``level``: captured in place from the recorded samples, or by a new driver."""
        fit = self._fit
        driver = self.driver
        if level.whole_step or not driver.switch_level(level.target_names):
            driver.release()
            eager_steps = eager_steps_before_whole_step(fit.trainer) if level.whole_step else 1
            settings = replace(self.settings, first_eager_steps=eager_steps)
            self.driver = fit.make_driver(level, _level_settings(self.ladder, settings), self._note_eager_baseline)
            self.reference.driver_built(self.driver)
            self.driver.take_seal_from(driver)
            self.driver.start(fit.trainer)
        else:
            driver.settings = _level_settings(self.ladder, driver.settings)
        fit.backend.renew_pool()
        fit.machine.begin_level()
        self._enter(level)

    def _enter(self, level: Level) -> None:
        fit = self._fit
        self.reference.checking = False
        if self.ladder.climbs and self.ladder.settled:
            self.reference.begin_check(fit.backend.timer())
        due = CHECK_STEPS if self.reference.checking else MEASURE_STEPS
        fit.level = LevelRun(fit.level.window, capture_mark=self.report.capture_ms_total, due=due)
        if not self.ladder.climbs:
            return
        self.report.level = level.name
        if not self.ladder.settled:
            self.ladder.row.status = "trying"
        else:
            rank_zero_info(f"{self.component}: scope='auto' goes back to {level.name!r}: {self.ladder.describe()}")

    def _settle(self) -> None:
        fit = self._fit
        self.driver.settings = replace(self.driver.settings, keep_samples=False, measure_pool=True)
        self.driver.settle()
        self.report.pool_mib = fit.backend.pool_mib()
        self.reference.begin_check(fit.backend.timer())
        fit.level = LevelRun(fit.level.window, capture_mark=self.report.capture_ms_total, due=CHECK_STEPS)
        rank_zero_info(f"{self.component}: scope='auto' settled on {self.report.level!r}: {self.ladder.describe()}")

    def _note_capture_time(self) -> None:
        """Add the captures since the level began to its row."""
        self.ladder.row.capture_ms += self._fit.level.captures_since(self.report.capture_ms_total)

    def release(self) -> None:
        """The fit ends: nothing pending; the driver releases everything it holds, then the factory (idempotent)."""
        self._pending = None
        try:
            self.driver.release()
        finally:
            if self._running is not None:
                self._running.make_driver.release()


def _level_settings(ladder: Ladder, settings: LevelSettings) -> LevelSettings:
    """A walked ladder's settings for the level it enters; a fixed scope's stay as they are.

    Regions capture without capture warmup iterations (they already ran on this stream in every step so far), keep
    their samples while other levels may need them, and read the pool's size once, on the level kept.
    """
    if not ladder.climbs:
        return settings
    return replace(settings, warmup_iters=0, keep_samples=not ladder.settled, measure_pool=ladder.settled)
