"""The staged rollout of one fit: preflight, then a driver for the capture mode, a backend, timing and logging.

The callback and the strategy report Lightning events here; where the fit is lives in the stage machine
(:mod:`lightning_cudagraph.stages`); capture mechanics in a driver (:mod:`lightning_cudagraph.drivers`) that uses a
capture backend (:mod:`lightning_cudagraph.graphs.backend`); counters and logging in
:mod:`lightning_cudagraph.health`. The README's seven stages map onto the code as follows: 1 preflight
(:meth:`Rollout.setup`, :meth:`Rollout.fit_start`), 2 eager stabilization, 3 fixed shapes, 4 capture, 5 replay
confirmation and 6 replay (the drivers), 7 release (:meth:`Rollout.release`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph import preflight
from lightning_cudagraph.agreement import RankAgreement
from lightning_cudagraph.batches import batch_key, opaque_reason
from lightning_cudagraph.climb import Climb
from lightning_cudagraph.compiling import CompiledForwards, CompiledModules, CompileWatch, called_modules
from lightning_cudagraph.config import CUDAGraphConfig
from lightning_cudagraph.drivers.base import Driver
from lightning_cudagraph.drivers.regions import RegionSet
from lightning_cudagraph.drivers.scoped import ScopedDriver
from lightning_cudagraph.drivers.whole_step import WholeStepDriver as FullStepDriver
from lightning_cudagraph.graphs.backend import CaptureBackend
from lightning_cudagraph.graphs.cuda import default_backend
from lightning_cudagraph.health import CUDAGraphReport, Stage
from lightning_cudagraph.ladder import Rung, build_rungs, replacement_parts
from lightning_cudagraph.reporting import ProgressBarItems, log_through_lightning, log_to_loggers
from lightning_cudagraph.scopes import ScopeResolution, Target, candidate_names, resolve_scopes
from lightning_cudagraph.stages import StageMachine
from lightning_cudagraph.timing import StepTimer, median


class Rollout:
    """Drives one fit through the stages, for a :class:`~lightning_cudagraph.config.CUDAGraphConfig`.

    Args:
        config: The validated options.
        component: Named in messages and errors.
        backend: The capture backend; ``None`` picks CUDA on a CUDA device (and graphs off elsewhere).
    """

    def __init__(self, config: CUDAGraphConfig, component: str, backend: CaptureBackend | None = None) -> None:
        self.config = config
        self.component = component
        self.report = CUDAGraphReport()
        self.machine = StageMachine(self.report, component, config.on_failure, release=self.release)
        self.resolution = ScopeResolution()
        self.backend = backend
        self._driver: Driver | None = None
        #: ``scope="auto"``: the ladder of levels and its walk (``None`` for a fixed scope).
        self.climb: Climb | None = None
        self._parts: dict[str, tuple[Target, ...]] = {}
        self._timer = StepTimer(use_cuda=False)
        self._eager_times: list[float] = []
        self._eager_noted = False
        self._last_logged = -1
        self._sealed = False
        #: ``compile=``: the watch on dynamo's compilations, and what the package compiled (released with the fit).
        self.compile_watch: CompileWatch | None = None
        self._compiled_modules: CompiledModules | None = None
        self._compiled_forwards: CompiledForwards | None = None

    @property
    def stage(self) -> Stage:
        """The current stage."""
        return self.machine.stage

    @property
    def active(self) -> bool:
        """Whether graphs may still be captured or replayed in this fit."""
        return self.machine.graphs_allowed and self.driver is not None

    # ------------------------------------------------------------------ stage 1: preflight
    def setup(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Validate against the Trainer and resolve scopes to modules (no CUDA work)."""
        if not self.config.enabled:
            self.machine.disable("impl_none", warn=False)
            return
        with self._refusals_disable():
            preflight.check_trainer(self.config, trainer, module, self.component)
            if self.config.auto_scope:
                preflight.check_auto_overrides(self.config, module, self.component)
                rungs = build_rungs(module, self.config.modules, preflight.full_step_problem(self.config, trainer))
                self.climb = Climb(self._checked_rungs(rungs), self.report, self.component)
                self.report.scopes = {row.level: [] for row in self.report.ladder if row.status != "skipped"}
            elif not self.config.full_iteration:
                self.resolution = resolve_scopes(module, self.config.scope, self.config.modules, self.component)
                preflight.check_targets(self.resolution.targets, self.component)
        if self.config.full_iteration:
            self.report.scopes = {"full_iteration": ["<training step>"]}
        elif self.climb is not None:
            if self.climb.ladder.current is None:
                self.machine.disable(
                    "no_targets",
                    detail="scope='auto' found no attention, MLP or layer modules and cannot capture the whole step"
                    f" ({self.climb.ladder.describe()}); modules include {candidate_names(module)}. Pass"
                    " scope=[...] with modules={...} to choose some",
                )
                return
            self.report.scopes = {rung.name: [t.name for t in rung.targets] for rung in self.climb.rungs}
            rank_zero_info(f"{self.component}: scope='auto' will try {self.climb.ladder.describe()}")
        else:
            self.report.scopes = self.resolution.matched
            rank_zero_info(f"{self.component}: {self.resolution.summary()}")
        if self.climb is not None and self.config.impl == "local":  # the layer level narrows to parts (TE: no)
            self._parts = replacement_parts(module, self.climb.scoped_targets, self.config.modules)
        self.backend = self.backend or default_backend(trainer.strategy.root_device)

    def _checked_rungs(self, rungs: list[Rung]) -> list[Rung]:
        """Rungs whose regions a capture cannot hold (activation checkpointing) are skipped, with the reason."""
        checked = []
        for rung in rungs:
            try:
                preflight.check_targets(rung.targets, self.component)
            except ValueError as error:
                rung = Rung(rung.name, unavailable=str(error))
            checked.append(rung)
        return checked

    def fit_start(self, trainer: pl.Trainer) -> None:
        """Check the optimizers, then pick the driver, or turn graphs off when there is no device to capture on."""
        if not self.machine.graphs_allowed:
            return
        with self._refusals_disable():
            preflight.check_optimizers(self.config, trainer, self.component)
            preflight.check_full_iteration_hooks(self.config, trainer.lightning_module, self.component)
        if self.climb is not None:
            self.climb.check_full_step(preflight.full_step_optimizer_problem(self.config, trainer))
        if self.backend is None:
            self.machine.disable(
                "no_cuda",
                detail=f"CUDA graphs need a CUDA device, but this Trainer runs on {trainer.strategy.root_device.type};"
                " training runs eagerly, exactly as without the package",
            )
            return
        self._timer = self.backend.timer()
        self.machine.agreement = RankAgreement(trainer.strategy.root_device)
        if self.config.compile is not None:
            self._start_compiling()
        if self.climb is not None:
            self.climb.attach(trainer, self.backend, self.machine, functools.partial(self.driver_for, trainer))
        else:
            targets = [t.name for t in self.resolution.targets]
            self._driver = self.driver_for(trainer, self.config.full_iteration, targets)

    def driver_for(self, trainer: pl.Trainer, full_step: bool, active: list[str]) -> Driver:
        """A driver for the whole step, or for scoped regions with ``active`` targets captured."""
        collaborators = (self.config, self.component, self.backend, self.machine)
        if full_step:
            driver: Driver = FullStepDriver(*collaborators)
        else:
            patched = self.climb.scoped_targets if self.climb is not None else self.resolution.targets
            patched = _with_parts(patched, self._parts)
            regions = RegionSet(patched, active, self._parts, self.report, self.component)
            if self.config.impl == "transformer_engine":
                from lightning_cudagraph.drivers.te_scoped import TEScopedDriver

                driver = TEScopedDriver(trainer, regions, *collaborators)
            else:
                driver = ScopedDriver(regions, *collaborators, compiled=self._compiled_forwards)
        driver.before_first_capture = self._note_eager_time
        return driver

    @property
    def driver(self) -> Driver | None:
        """The driver of the capture mode in use (under ``scope="auto"``, the current level's)."""
        return self.climb.driver if self.climb is not None else self._driver

    def train_start(self, trainer: pl.Trainer) -> None:
        """Move training onto the backend's stream and start eager stabilization."""
        if not self.active:
            return
        self.backend.enter()
        self.driver.start(trainer)
        if self._compiled_modules is not None and isinstance(self.driver, FullStepDriver):
            self._compiled_modules.compile(called_modules(trainer.lightning_module))

    def _start_compiling(self) -> None:
        """``compile=``: watch dynamo from now on; compile the whole step's modules, or each target's forward."""
        self.compile_watch = CompileWatch(self.report, self.component)
        self.compile_watch.install()
        if self.config.full_iteration:
            self._compiled_modules = CompiledModules(self.config.compile)
        else:
            self._compiled_forwards = CompiledForwards(self.config.compile)

    # ------------------------------------------------------------------ training batches
    def batch_start(self, trainer: pl.Trainer, batch: Any) -> None:
        """Scoped graphs: decide what this batch does with the targets. Then start its timer."""
        if self.active:
            self._seal_when_due(trainer.global_step)
        if self._compiled_modules is not None:
            self._compiled_modules.active = self.active  # compiled for training steps only (not evaluation)
        if self.active and isinstance(self.driver, ScopedDriver):
            key = batch_key(batch)
            opaque = opaque_reason(batch) if key is None else ""
            self.driver.begin_step(trainer.global_step, key, trainer.accumulate_grad_batches > 1, opaque)
        self._timer.start()
        if self.climb is not None:
            self.climb.step_started()

    def batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any) -> None:
        """Close the step: confirmation checks, stage changes, metrics; then the ladder's move, if one is due."""
        self._timer.stop()
        if self._compiled_modules is not None:
            self._compiled_modules.active = False
        if self.driver is not None:
            self.driver.end_step(outputs)
            if self.machine.stage == Stage.WARMUP:
                self.machine.warmup_losses.observe(outputs)
        if self.climb is not None:
            self.climb.step_ended()
        self._maybe_log(trainer, module)
        if self.climb is not None:
            self.climb.move_if_due()

    def abandon_step(self) -> None:
        """Close a training batch that never reached ``on_train_batch_end`` (``on_train_batch_start`` returned -1)."""
        if self.driver is not None:
            self.driver.abandon_step()

    # ------------------------------------------------------------------ whole steps (called by the strategy)
    def plan_full_step(self, trainer: pl.Trainer, batch: Any) -> Any:
        """Before a training step: plan it (eager, capture or replay) and return the batch it should use."""
        if not (self.active and isinstance(self.driver, FullStepDriver)):
            return batch
        if not trainer.training or trainer.sanity_checking:
            return batch
        self._seal_when_due(trainer.global_step)
        return self.driver.plan(trainer, batch)

    def run_full_step(self, trainer: pl.Trainer, closure: Any, optimizer: Any, run_step: Callable[[], Any]) -> Any:
        """Carry out the planned step."""
        if not isinstance(self.driver, FullStepDriver):
            return run_step()
        return self.driver.run(trainer, closure, optimizer, run_step)

    def on_training_step_output(self, output: Any) -> None:
        """``training_step`` returned (while capturing, this is the captured output)."""
        if isinstance(self.driver, FullStepDriver):
            self.driver.on_training_step_output(output)

    @property
    def capturing_full_step(self) -> bool:
        """Whether the strategy's hooks are running inside a whole-step capture."""
        return isinstance(self.driver, FullStepDriver) and self.driver.capturing

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
            self.machine.disable("not_engaged", detail=self._why_not_engaged(trainer))
            self.report.reason = f"not_engaged: {self._why_not_engaged(trainer)}"
        self.flush(trainer)
        self.release()

    def _why_not_engaged(self, trainer: pl.Trainer) -> str:
        """Why a fit that ends now never replayed graphs in steady state."""
        steps, level = trainer.global_step, f" at level {self.report.level!r}" if self.report.level else ""
        if self.stage == Stage.CONFIRMING:
            return (
                f"the fit ended during replay confirmation{level} after {steps} optimizer step(s); the graphs were"
                f" never trusted (confirm_steps={self.config.confirm_steps}: raise max_steps)"
            )
        eager = self.driver.first_eager_steps if self.driver is not None else self.config.warmup_steps
        if steps <= eager:
            return (
                f"the fit ended after {steps} optimizer step(s), within the {eager} eager warmup step(s) before"
                f" capture{level} (raise max_steps or lower warmup_steps)"
            )
        return f"no graph was captured{level} in {steps} optimizer step(s) (the targets did not run in a training step)"

    def release(self) -> None:
        """Free every graph and restore everything patched (idempotent; called on every exit path)."""
        try:
            if self.climb is not None:
                self.climb.release()
            if self.driver is not None:
                self.driver.release()
        finally:  # whatever a reset raised, training goes back to the stream it came from
            try:
                self._stop_compiling()
            finally:
                if self.backend is not None:
                    self.backend.release()

    def _stop_compiling(self) -> None:
        """Give the compiled modules their own call back, drop compiled functions, stop watching dynamo."""
        if self._compiled_modules is not None:
            self._compiled_modules.restore()
        if self._compiled_forwards is not None:
            self._compiled_forwards.clear()
        if self.compile_watch is not None:
            self.compile_watch.remove()

    def save_checkpoint(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
        """Keep checkpoints free of the package: optimizers are saved in the form the user built them."""
        if self.driver is not None:
            self.driver.save_checkpoint(trainer.optimizers, checkpoint)

    # ------------------------------------------------------------------ timing and logging
    def _note_eager_time(self) -> None:
        """Right before the first capture: the eager step times so far (one host sync, at capture)."""
        if self.compile_watch is not None:
            self.compile_watch.captured = True  # a compilation from now on is a recompile
        if self._eager_noted:
            return
        self._eager_noted = True
        self._eager_times.extend(self._timer.read())
        times = self._eager_times[1:] if len(self._eager_times) > 1 else self._eager_times
        (self.report.eager_step_ms,) = self.machine.agreement.slowest(median(times))

    def _maybe_log(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Once per ``log_every_n_steps`` (and when the Trainer stops): health checks, step times, metrics, the bar."""
        step = trainer.global_step
        if step == self._last_logged or (step % max(trainer.log_every_n_steps, 1) and not trainer.should_stop):
            return
        self._last_logged = step
        if self.driver is not None:
            self.driver.health_check(step)
        metrics = self._interval_metrics()
        if self._logs_metrics(trainer):
            # One log_dict, from on_train_batch_end: the rows Lightning writes for the user's metrics at this step.
            log_through_lightning(module, metrics)
        if self.driver is not None:
            self._bar.show_on(trainer.progress_bar_callback)

    def flush(self, trainer: pl.Trainer) -> None:
        """At ``on_train_end``: take the stage off the bar; log a last interval that Lightning's cadence did not write.

        Lightning refuses ``self.log`` in ``on_train_end``, so those metrics go to the loggers directly (rank zero),
        at the step Lightning would have used. Nothing is written when the last step was a logging step.
        """
        self._bar.remove()
        step = trainer.global_step
        if step == self._last_logged:
            return
        self._last_logged = step
        metrics = self._interval_metrics()
        if self._logs_metrics(trainer):
            log_to_loggers(trainer, metrics, step=max(step - 1, 0))

    def _interval_metrics(self) -> dict[str, float]:
        """Read the interval's step times (one host sync on CUDA, none per step) and return the report's metrics."""
        times = self._timer.read()
        if self.stage == Stage.WARMUP and not self._eager_noted:
            self._eager_times.extend(times)
        elif times:
            self.report.step_ms = median(times)
        return self.report.metrics()

    def _logs_metrics(self, trainer: pl.Trainer) -> bool:
        """Whether ``cudagraph/*`` metrics are logged in this fit.

        Not when graphs were off before training began (``no_cuda``, ``impl_none``, ``no_targets``: no driver was
        made): every figure would be a zero that means nothing, so a fit without graphs logs what it would log
        without the package (``callback.report`` and the warning say why). Not with ``log_every_n_steps=0`` either.
        """
        return self.driver is not None and trainer.log_every_n_steps > 0

    @functools.cached_property
    def _bar(self) -> ProgressBarItems:
        """The ``graphs`` item of the progress bar (shown only once a driver exists: nothing when graphs are off)."""
        return ProgressBarItems(self._bar_items)

    def _bar_items(self) -> dict[str, str]:
        """``graphs=replaying``: the stage by name, the level under ``scope="auto"``, the speedup once measured."""
        shown = self.stage.label
        if self.climb is not None and self.report.level:
            shown += f" {self.report.level}"
        if not math.isnan(self.report.speedup):
            shown += f" {self.report.speedup:.2f}x"
        return {"graphs": shown}

    @contextlib.contextmanager
    def _refusals_disable(self) -> Iterator[None]:
        """A refused configuration leaves the report saying so (stage -1, ``invalid_configuration``), then raises."""
        try:
            yield
        except ValueError as error:
            self.machine.disable(f"invalid_configuration: {error}", warn=False)
            raise


def _with_parts(targets: list[Target], parts: dict[str, tuple[Target, ...]]) -> list[Target]:
    """The targets and the parts that may replace them, each once, parents before their parts."""
    patched: dict[str, Target] = {}
    for target in targets:
        patched.setdefault(target.name, target)
        for part in parts.get(target.name, ()):
            patched.setdefault(part.name, part)
    return list(patched.values())
