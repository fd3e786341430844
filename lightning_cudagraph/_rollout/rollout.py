"""The staged rollout of one fit: preflight and the plan of its levels, then the level runner, timing and logging.

The callback and the strategy report Lightning events here. Of the README's seven stages, preflight
(:meth:`Rollout.setup`, :meth:`Rollout.fit_start`) and release (:meth:`Rollout.release`) run here; eager
stabilization, fixed shapes, capture, replay confirmation and replay run in the drivers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph._backend.backend import CaptureBackend
from lightning_cudagraph._backend.cuda import default_backend
from lightning_cudagraph._graphs.base import Driver, LevelSettings
from lightning_cudagraph._options.config import FULL_ITERATION, CUDAGraphConfig
from lightning_cudagraph._options.levels import Plan
from lightning_cudagraph._rollout import planning, preflight
from lightning_cudagraph._rollout.climb import Climb
from lightning_cudagraph._rollout.evaluation import EvaluationGraphs, TrainedLevel
from lightning_cudagraph._rollout.factory import DriverFactory
from lightning_cudagraph._rollout.fit_log import FitLog
from lightning_cudagraph._rollout.reporting import why_not_engaged
from lightning_cudagraph._rollout.step_python import StepPython
from lightning_cudagraph._trust.agreement import RankAgreement
from lightning_cudagraph._trust.failure import FailurePolicy
from lightning_cudagraph._trust.observation import Observer
from lightning_cudagraph._trust.stages import StageMachine
from lightning_cudagraph.health import CUDAGraphReport, Stage


class Rollout:
    """Drives one fit through the stages, for a :class:`~lightning_cudagraph._options.config.CUDAGraphConfig`.

    A ``backend`` of ``None`` picks CUDA on a CUDA device (and graphs off elsewhere).
    """

    def __init__(self, config: CUDAGraphConfig, backend: CaptureBackend | None = None) -> None:
        self.config = config
        self.component = config.component
        self.report = CUDAGraphReport()
        policy = FailurePolicy(config.component, config.on_failure, auto_scope=config.auto_scope)
        self.machine = StageMachine(self.report, policy, release=self.release)
        self.backend = backend
        #: The level runner: idle (no level, an idle driver) until setup plans the levels and fit start attaches it.
        self.climb = Climb(Plan((), climbs=False), self.report, config.component, LevelSettings.of(config))
        self.log = FitLog(self.report)
        self.evaluation = EvaluationGraphs(config, self.report.evaluation)
        self._sealed = False
        #: Whether the strategy hands every micro-batch of an accumulation window to the whole step (set at fit start).
        self.whole_step_accumulation = False
        #: What the eager steps' Python showed (the package's strategies run the whole step: it is watched there).
        self.step_python = StepPython(Observer(trace=config.compile is None), config.component)
        self._plan_summary = ""  # what the levels would capture, said in the no_cuda message on a CPU

    @property
    def stage(self) -> Stage:
        """The current stage."""
        return self.machine.stage

    @property
    def driver(self) -> Driver:
        """The driver of the level training is on (an idle one, whose hooks do nothing, until fit start built one)."""
        return self.climb.driver

    @property
    def active(self) -> bool:
        """Whether graphs may still be captured or replayed in this fit."""
        return self.machine.graphs_allowed and self.climb.attached

    # ------------------------------------------------------------------ stage 1: preflight
    def setup(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Validate against the Trainer and plan every level of the fit (no CUDA work)."""
        if not self.config.enabled:
            self.machine.disable("impl_none", warn=False)
            return
        with self._refusals_disable():
            preflight.check_trainer(self.config, trainer, module)
            plan = planning.plan(self.config, trainer, module)
        self.climb = Climb(plan, self.report, self.component, LevelSettings.of(self.config))
        self.report.scopes = dict(plan.scopes)
        if self.climb.ladder.current is None:
            self.machine.disable("no_targets", detail=plan.summary)
            return
        self.backend = self.backend or default_backend(trainer.strategy.root_device)
        self._plan_summary = plan.summary
        if self.backend is not None:  # without one, fit start says graphs are off (no_cuda), with the plan in it
            rank_zero_info(f"{self.component}: {plan.summary}")

    def fit_start(self, trainer: pl.Trainer) -> None:
        """Check the optimizers, then start the level runner, or turn graphs off with no device to capture on."""
        if not self.machine.graphs_allowed or self.climb.ladder.current is None:  # off, or no level planned
            return
        with self._refusals_disable():
            problem = preflight.whole_step_optimizer_problem(self.config, trainer)
            preflight.check_whole_step_hooks(self.config, trainer)
            preflight.check_seal_within_the_fit(self.config, trainer)
        if problem is not None:
            self.climb.ladder.skip(FULL_ITERATION, problem)
        if self.backend is None:
            self.machine.disable(
                "no_cuda",
                detail=f"CUDA graphs need a CUDA device, but this Trainer runs on {trainer.strategy.root_device.type};"
                f" training runs eagerly, exactly as without the package. On a CUDA device: {self._plan_summary}",
            )
            return
        self.step_python.refuse_optimizer_hooks(trainer, self.machine, self.climb.ladder)
        if not self.machine.graphs_allowed:
            return
        module = trainer.lightning_module  # an optimizer_step override would run for every micro-batch: not handed
        self.whole_step_accumulation = (
            module.automatic_optimization
            and not is_overridden("optimizer_step", module)
            and any(level.whole_step for level in self.climb.ladder.to_try)
        )
        self.machine.agreement = RankAgreement(trainer.strategy.root_device)
        # DDP rebuilds its gradient buckets on the second step, with one process too: a set-up step as well.
        self.step_python.setup_steps = 2 if isinstance(trainer.strategy, DDPStrategy) else 1
        factory = DriverFactory(
            self.config, self.backend, self.machine, trainer, self.climb.plan, self.step_python.observer
        )
        self.climb.attach(trainer, self.backend, self.machine, factory)

    def train_start(self, trainer: pl.Trainer) -> None:
        """Move training onto the backend's stream and start eager stabilization."""
        if self.active:
            self.climb.train_started(trainer, self.config.confirm_steps)

    # ------------------------------------------------------------------ training batches
    def batch_start(self, trainer: pl.Trainer, batch: Any) -> None:
        """Seal the shapes when due, then hand the batch to the level runner (its driver, its timer)."""
        if self.active:
            self._seal_when_due(trainer.global_step)
        self.climb.batch_started(trainer, batch)

    def batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any) -> None:
        """Close the step; once per interval the health check and the metrics; then the ladder's move, if one is due."""
        self.climb.batch_ended(outputs)
        if self.log.interval_ended(trainer):
            self.driver.health_check(trainer.global_step)  # it may roll back: before the metrics say where the fit is
            self.log.write(trainer, module, self.climb)
        self.climb.move_if_due()

    def abandon_step(self) -> None:
        """Close a training batch that never reached ``on_train_batch_end`` (``on_train_batch_start`` returned -1)."""
        self.driver.abandon_step()

    # ------------------------------------------------------------------ whole steps (called by the strategy)
    def plan_whole_step(self, trainer: pl.Trainer, batch: Any) -> Any:
        """Before a training step: the driver plans it (eager, capture or replay) and returns the batch to use."""
        driver = self.driver
        watched = self.active and trainer.training and not trainer.sanity_checking
        if watched:
            self._seal_when_due(trainer.global_step)
            self.step_python.plan(trainer, driver, self.climb.ladder, self.stage)
        planned = driver.plan(trainer, batch)
        if watched:
            self.step_python.planned(trainer, batch, driver, self.stage)
        return planned

    def run_whole_step(self, trainer: pl.Trainer, closure: Any, optimizer: Any, run_step: Callable[[], Any]) -> Any:
        """Carry out the planned step (eagerly, by ``run_step``, below the whole step), observed when planned so."""
        driver = self.driver
        step = lambda: driver.run(trainer, closure, optimizer, run_step)  # noqa: E731
        return self.step_python.run(trainer, driver, self.machine, self.climb.ladder, step)

    def run_training_step(self, trainer: pl.Trainer, run_step: Callable[[], Any]) -> Any:
        """Under manual optimization: ``training_step`` steps the optimizers, so it is the step a whole step holds."""
        driver = self.driver
        step = lambda: driver.run_training_step(trainer, run_step)  # noqa: E731
        return self.step_python.run(trainer, driver, self.machine, self.climb.ladder, step)

    def run_manual_update(self, trainer: pl.Trainer, closure: Any, optimizer: Any, run_step: Callable[[], Any]) -> Any:
        """An optimizer step that a manual ``training_step`` takes (its settings are watched apart from its trace)."""
        self.step_python.pause_trace()
        try:
            return self.driver.run_manual_update(trainer, closure, optimizer, run_step)
        finally:
            self.step_python.resume_trace()

    def on_backward(self, loss: Any) -> None:
        """The step backpropagates ``loss`` (while capturing a manual step: its non-finite check is captured)."""
        if self.driver.capturing:
            self.driver.on_backward(loss)

    def training_step_arguments(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``training_step`` 's arguments; in an observed step, ``batch_idx`` notes where user code reads it."""
        return self.step_python.step_arguments(args)

    def on_training_step_output(self, output: Any) -> None:
        """``training_step`` returned (while capturing, this is the captured output)."""
        self.step_python.step_output(output)
        if self.driver.capturing:
            self.driver.on_training_step_output(output)

    def before_optimizer_step(self) -> None:
        """The optimizer's update starts: an observed step's trace ends here (its settings are watched apart)."""
        self.step_python.pause_trace()

    # ------------------------------------------------------------------ evaluation loops
    def evaluation_start(self, trainer: pl.Trainer, backend: CaptureBackend | None = None) -> None:
        """An evaluation loop starts: its graphs, or eager with the reason; ``backend`` serves a loop outside a fit."""
        if self.backend is None and self.config.enabled and self.config.eval_graphs and not trainer.sanity_checking:
            self.backend = backend or default_backend(trainer.strategy.root_device)  # a loop outside a fit
        strategy = bool(getattr(trainer.strategy, "supports_full_iteration", False))
        self.evaluation.loop_start(trainer, self.backend, self._trained_level(), strategy)

    def _trained_level(self) -> TrainedLevel:
        """What the fit's training graphs are now."""
        current = self.climb.ladder.current
        return TrainedLevel(
            name=current.name if current is not None else None,
            settled=self.climb.ladder.settled,
            allowed=self.active,
            off_reason=self.report.reason,
            regions=self.driver.captured_modules() if self.active else [],
        )

    def plan_evaluation_step(self, trainer: pl.Trainer, batch: Any) -> Any:
        """``batch_to_device`` of an evaluation batch (called by the strategy): the batch its step should read."""
        return self.evaluation.plan(trainer, batch)

    def run_evaluation_step(self, trainer: pl.Trainer, step: Callable[[], Any]) -> Any:
        """An evaluation step (called by the strategy): replayed, captured, or eager."""
        return self.evaluation.run(trainer.lightning_module, step)

    def evaluation_end(self) -> None:
        """An evaluation loop ended: trained regions get their forwards back; a loop outside a fit releases."""
        self.evaluation.loop_end()

    # ------------------------------------------------------------------ shapes
    def seal(self, self_check: bool = True) -> None:
        """Close the set of batch shapes: a shape without graphs raises from now on (``seal_after_steps``)."""
        if self.active and not self._sealed:
            self._sealed = True
            self.driver.seal(self_check)
            check = "; each captured shape is checked against eager once more" if self_check else ""
            rank_zero_info(f"{self.component}: the set of batch shapes is sealed: another shape raises{check}")

    def _seal_when_due(self, step: int) -> None:
        if self.config.seal_after_steps is not None and step >= self.config.seal_after_steps:
            self.seal()

    # ------------------------------------------------------------------ stage 7: release, checkpoints
    def train_end(self, trainer: pl.Trainer) -> None:
        """The fit ended: say why if graphs never reached replay, send the last metrics, release."""
        if self.active and self.stage in (Stage.WARMUP, Stage.CONFIRMING):
            why = why_not_engaged(self.report, self.stage, trainer.global_step, self.driver, self.config)
            self.machine.disable("not_engaged", detail=why)
            self.report.reason = f"not_engaged: {why}"
        self.log.flush(trainer, self.climb)
        self.release()

    def release(self) -> None:
        """Free every graph and restore everything patched (idempotent; called on every exit path)."""
        try:
            try:
                self.evaluation.release()  # first: its forwards wrap the training driver's
            finally:
                self.climb.release()  # its driver, then its factory
        finally:  # whatever a reset raised, training goes back to the stream it came from
            if self.backend is not None:
                self.backend.release()

    def save_checkpoint(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
        """Keep checkpoints free of the package: optimizers are saved in the form the user built them."""
        self.driver.save_checkpoint(trainer.optimizers, checkpoint)

    @contextlib.contextmanager
    def _refusals_disable(self) -> Iterator[None]:
        """A refused configuration leaves the report saying so (stage -1, ``invalid_configuration``), then raises."""
        try:
            yield
        except ValueError as error:
            self.machine.disable(f"invalid_configuration: {error}", warn=False)
            raise
