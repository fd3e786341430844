"""The whole-step driver: ``training_step``, backward, clipping and the optimizer step as one graph.

The strategy hands it the batch (``batch_to_device``: :meth:`WholeStepDriver.plan` makes a :data:`StepPlan`), the
output of ``training_step`` (captured output and in-graph non-finite check), and the step itself
(``optimizer_step``: :meth:`WholeStepDriver.run` carries the plan out). A replayed step rebuilds Lightning's closure
result and re-issues the captured ``self.log`` calls, so the loop, loggers, checkpointing and early stopping behave
as in eager training.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph._lightning import set_closure_result, step_loss
from lightning_cudagraph.batches import batch_key, describe_batch_key, opaque_reason, own_copy
from lightning_cudagraph.compiling import CompiledModules, called_modules
from lightning_cudagraph.config import CUDAGraphConfig
from lightning_cudagraph.drivers.base import Driver, LevelSettings, shape_change_error
from lightning_cudagraph.drivers.evidence import MetricUpdates, StateWatch
from lightning_cudagraph.drivers.shadow import compare, precision_state
from lightning_cudagraph.drivers.shape_cache import ShapeCache
from lightning_cudagraph.drivers.step_pieces import NonFiniteFlags, WholeStep
from lightning_cudagraph.graphs.backend import CaptureBackend, PreparedOptimizer
from lightning_cudagraph.graphs.optimizers import OptimizerSettings
from lightning_cudagraph.health import Stage
from lightning_cudagraph.snapshot import TrainingState
from lightning_cudagraph.stages import StageMachine


@dataclass(frozen=True)
class EagerStep:
    """Run the step eagerly; ``fallback`` says why while graphs are in use (counted), ``None`` during warmup."""

    fallback: str | None = None


@dataclass(frozen=True)
class CaptureStep:
    """Capture the step for this batch signature (its batch is the graph's static batch), then replay it."""

    key: tuple[Any, ...]
    whole: WholeStep


@dataclass(frozen=True)
class ReplayStep:
    """Replay the step captured for this batch signature."""

    key: tuple[Any, ...]


#: What the next optimizer step does: made by :meth:`WholeStepDriver.plan`, consumed by :meth:`WholeStepDriver.run`.
StepPlan = EagerStep | CaptureStep | ReplayStep


class WholeStepDriver(Driver):
    """Captures and replays whole training steps, one per batch signature.

    Args:
        config, component, backend, machine, settings: See :class:`~lightning_cudagraph.drivers.base.Driver`.
        compiled: ``compile=``: the step's modules to compile in place at :meth:`start`, on during training steps.
    """

    def __init__(
        self,
        config: CUDAGraphConfig,
        component: str,
        backend: CaptureBackend,
        machine: StageMachine,
        settings: LevelSettings | None = None,
        compiled: CompiledModules | None = None,
    ) -> None:
        super().__init__(config, component, backend, machine, settings)
        self.compiled = compiled
        self.steps: ShapeCache[WholeStep] = self._shape_cache(WholeStep.reset)
        self.optimizers: dict[int, PreparedOptimizer] = {}
        self.flags = NonFiniteFlags(self.backend.device)
        self.state = StateWatch()
        self._module: pl.LightningModule | None = None
        self._plan: StepPlan | None = None
        self._capturing: WholeStep | None = None
        self._first: WholeStep | None = None
        self._sightings: dict[tuple[Any, ...], int] = {}
        self._last_nonfinite_check = 0
        #: The optimizers as the user holds them, and their settings when graphs were captured (or at start).
        self._user_optimizers: list[torch.optim.Optimizer] = []
        self._settings: dict[int, OptimizerSettings] = {}
        self._since_audit = 0

    def start(self, trainer: pl.Trainer) -> None:
        """Switch optimizers to their capturable form for the whole fit, so their arithmetic never changes mid-run."""
        self._module = trainer.lightning_module
        self._last_nonfinite_check = trainer.global_step
        for optimizer in trainer.optimizers:
            self._prepare(optimizer)
        if self.compiled is not None:
            self.compiled.compile(called_modules(trainer.lightning_module))

    def begin_batch(self, trainer: pl.Trainer, batch: Any) -> None:
        """Turn the compiled modules on for this training step (evaluation runs them as built)."""
        if self.compiled is not None:
            self.compiled.active = self.machine.graphs_allowed

    def _prepare(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) not in self.optimizers:
            self.optimizers[id(optimizer)] = self.backend.prepare_optimizer(optimizer)
            self._user_optimizers.append(optimizer)
            self._settings[id(optimizer)] = OptimizerSettings.of(optimizer)

    def _settings_problem(self) -> str | None:
        """A rollback reason when an optimizer setting a graph bakes in (all but ``lr``) moved since capture."""
        for optimizer in self._user_optimizers:
            change = self._settings[id(optimizer)].change(OptimizerSettings.of(optimizer))
            if change is not None:
                return (
                    f"optimizer_setting_changed: {type(optimizer).__name__} {change} after the whole step was"
                    " captured; a graph replays the optimizer with the settings it was captured with (only lr is"
                    " read from the device). Fix: keep it fixed (OneCycleLR/CyclicLR(cycle_momentum=False)), or"
                    " use a scoped capture (scope=['layer']), whose optimizer runs eagerly"
                )
        return None

    # ------------------------------------------------------------------ the plan (``batch_to_device``)
    def plan(self, trainer: pl.Trainer, batch: Any) -> Any:
        """Decide what the next optimizer step does, and return the batch it should use (static buffers to replay)."""
        self._plan = None
        if not self.machine.graphs_allowed or not trainer.training or trainer.sanity_checking:
            return batch
        key = batch_key(batch, values=True)  # a graph bakes in the batch's non-tensor values too
        in_use = self.machine.stage != Stage.WARMUP
        if key is None:  # no key could tell this batch's graph: it runs eagerly, or graphs are off, with the reason
            if in_use:
                self._plan = EagerStep(fallback=f"opaque_batch: {opaque_reason(batch)}")
            else:
                self.machine.disable("opaque_batch", detail=opaque_reason(batch))
            return batch
        whole = self.steps.get(key)
        if whole is not None:
            self._plan = ReplayStep(key)
            return whole.stage(batch)
        captured = ", ".join(describe_batch_key(k) for k in self.steps.shapes())
        change = f"batch shape {describe_batch_key(key)} differs from the captured {captured}"
        if in_use:
            if not self.steps.admits(key):
                raise self.steps.sealed_error(key)
            if self.config.on_shape_change == "error":
                raise shape_change_error(self.component, change)
            if self.config.on_shape_change == "eager":
                self._plan = EagerStep(fallback=change)
                return batch
        self._sightings[key] = self._sightings.get(key, 0) + 1
        if self._sightings[key] <= self._eager_steps_needed():  # this shape's own eager steps
            self._plan = EagerStep(fallback=change if in_use else None)
            return batch
        if not in_use and not self.machine.warmup_was_finite():
            return batch
        # A copy of this batch becomes the static buffers of the step about to be captured: later batches are copied
        # into it, so it must never be the user's own tensors (a dataset on the device would be overwritten).
        whole = WholeStep(static_batch=own_copy(batch), confirm_left=self.config.confirm_steps)
        self._plan = CaptureStep(key, whole)
        return whole.static_batch

    # ------------------------------------------------------------------ carrying it out (``optimizer_step``)
    def run(
        self, trainer: pl.Trainer, closure: Any, optimizer: torch.optim.Optimizer, run_step: Callable[[], Any]
    ) -> Any:
        """Run the optimizer step as planned: eagerly, or captured then replayed."""
        plan, self._plan = self._plan, None
        if plan is None or isinstance(plan, EagerStep) or not self.machine.graphs_allowed:
            if self.machine.graphs_allowed and self.captured_any:
                self.report.steps_eager += 1
                if isinstance(plan, EagerStep) and plan.fallback is not None:
                    self.report.count_fallback(plan.fallback)
            return _eager(run_step)
        module = trainer.lightning_module
        problem = self._settings_problem()
        if problem is not None:  # a setting moved during warmup (it moves every step) or since capture
            self.machine.rollback(problem)
            return _eager(run_step)
        if isinstance(plan, CaptureStep):
            # Everything the step changes, copied before the capture: a capture that is not kept puts it back, and
            # the graph's first run is a shadow step from it, so no unchecked replay ever trains.
            state = self._state_before_step(trainer, module)
            first = self.machine.stage == Stage.WARMUP
            if not self._capture(plan, optimizer, run_step, module, state):
                return _eager(run_step)
            if first:
                self._first = plan.whole
                self.machine.begin_confirmation()
            return self._shadow(plan.whole, trainer, closure, run_step, module, state)
        problem = self.state.problem()
        if problem is not None:
            self.machine.rollback(problem)
            return _eager(run_step)
        whole = self.steps.get(plan.key)
        self._since_audit += 1
        if self._since_audit >= self._audit_every():
            return self._shadow(whole, trainer, closure, run_step, module, self._state_before_step(trainer, module))
        return self._replay(whole, trainer, closure, module)

    def _state_before_step(self, trainer: pl.Trainer, module: Any) -> TrainingState:
        return TrainingState.take(module, self._user_optimizers, self.backend.device, precision_state(trainer))

    def _audit_every(self) -> int:
        return self.config.audit_every_n_steps or 2**62  # None or 0: no audit after confirmation

    def _shadow(
        self,
        whole: WholeStep,
        trainer: pl.Trainer,
        closure: Any,
        run_step: Callable[[], Any],
        module: Any,
        state: TrainingState,
    ) -> Any:
        """Check the graph against the eager step from the same state on the same batch; train on the eager one.

        The graph replays first, from ``state`` (a copy of everything the step changes); its loss and parameters
        are kept, the copy is put back, and the step runs eagerly: that is the step training keeps, so a graph that
        fails the check never touched the weights. One host sync, for the decision.
        """
        whole.shadowed, self._since_audit = True, 0
        graphed = self._replay(whole, trainer, closure, module, reissue=False)
        graph_loss, graph_params = step_loss(graphed), state.parameters_now()
        state.restore()
        output = _eager(run_step)
        state.keep_gradient_buffers()
        verdict = compare(trainer, state, graph_params, graph_loss, step_loss(output))
        self.report.audits += 1
        previous = self.report.parity_err
        self.report.parity_err = verdict.error if math.isnan(previous) else max(previous, verdict.error)
        if not verdict.passed:
            self.machine.rollback(verdict.reason(trainer.global_step))
        return output

    def _capture(
        self,
        plan: CaptureStep,
        optimizer: torch.optim.Optimizer,
        run_step: Callable[[], Any],
        module: Any,
        before: TrainingState,
    ) -> bool:
        whole, first = plan.whole, not self.captured_any
        self._before_first_capture()
        self._prepare(optimizer)
        self._note_memory_before_capture()
        metrics = MetricUpdates([("", module)])
        # The capture runs training_step's Python once; if its graph is not kept, the step runs again eagerly, so
        # what that Python changed (metric states and counters, module attributes, generators) is put back first.

        def body() -> None:  # what the graph holds; its Python runs while capturing only
            self._capturing = whole
            try:
                with whole.logs.recorded(module):
                    run_step()
            finally:
                self._capturing = None

        started = time.perf_counter()
        error: Exception | None = None
        try:
            with self.backend.failure_guard():
                whole.graph = self.backend.capture_step(body)
        except Exception as err:  # roll back loudly (or raise); the step then runs eagerly
            error = err
        finally:
            self.report.capture_ms_total += (time.perf_counter() - started) * 1e3
        if not self.machine.agreement.all_ok(error is None):  # a rank whose capture worked drops it too
            if whole.graph is not None:
                whole.graph.reset()
                whole.graph = None
            updated = metrics.changed()  # before the state (update counters included) is put back
            before.restore()
            if updated and error is not None:  # torchmetrics' own host syncs fail the capture: name the cause
                self.machine.rollback(_metric_in_graph(updated, f" (its capture failed: {error})"), error)
            else:
                self._capture_failed(error or RuntimeError("the capture failed on another rank"))
            return False
        self.steps.add(plan.key, whole)
        self._sightings.pop(plan.key, None)
        if not self._captured(started, len(self.steps), undo=before.restore):
            return False
        updated = metrics.changed()
        if updated:
            before.restore()
            self.machine.rollback(_metric_in_graph(updated))
            return False
        for optimizer in self._user_optimizers:  # what this graph bakes in
            self._settings[id(optimizer)] = OptimizerSettings.of(optimizer)
        if first:  # later shapes must read the same tensors: a rebind in between is caught, not re-watched
            self.state.watch((*module.named_parameters(), *module.named_buffers()))
        rank_zero_info(f"{self.component}: captured the training step for batch {describe_batch_key(plan.key)}")
        return True

    def _replay(self, whole: WholeStep, trainer: pl.Trainer, closure: Any, module: Any, reissue: bool = True) -> Any:
        for optimizer in self.optimizers.values():
            optimizer.refresh()
        self.flags.current_step.fill_(trainer.global_step)
        whole.graph.replay()
        self.report.replays += 1
        self.report.steps_replayed += 1
        output = whole.output_copy()
        if reissue:
            set_closure_result(closure, output, trainer.accumulate_grad_batches)
            whole.logs.reissue(module)
        whole.confirm_left -= 1
        return output

    @property
    def shape_cache(self) -> ShapeCache[WholeStep]:
        """The captured steps by batch shape."""
        return self.steps

    @property
    def capturing(self) -> bool:
        """Whether the strategy's hooks are running inside a whole-step capture."""
        return self._capturing is not None

    def on_training_step_output(self, output: Any) -> None:
        """While capturing: keep ``training_step`` 's output (static tensors) and add the non-finite check."""
        whole = self._capturing
        if whole is None:
            return
        whole.output = output
        loss = step_loss(output)
        if loss is not None:
            self.flags.update(loss)

    # ------------------------------------------------------------------ confirmation, health, release
    def end_step(self, outputs: Any) -> None:
        """Confirm once the first shape replayed ``confirm_steps`` times (its parameters checked before each)."""
        if self.compiled is not None:
            self.compiled.active = False
        if not self.machine.graphs_allowed:
            return
        shape = self._first
        if self.machine.stage == Stage.CONFIRMING and shape is not None and shape.confirm_left <= 0 and shape.shadowed:
            count, first = self.flags.read_and_clear()  # the decision's one host sync
            self.machine.confirm(graphs=self.report.graphs, nonfinite_first_step=first if count else None)

    def seal(self, self_check: bool) -> None:
        """Close the set of batch shapes (a whole step has no forward to compare apart: no parity self-check)."""
        self.steps.seal()

    def health_check(self, step: int) -> None:
        """Read the in-graph non-finite counter (one host sync per log interval, once a step is captured)."""
        if not len(self.steps) or not self.machine.graphs_allowed:
            return
        count, first = self.flags.read_and_clear()
        since, self._last_nonfinite_check = self._last_nonfinite_check, step
        if count:
            self.report.nonfinite.append((first, count))
        if self.machine.agreement.any_of([count > 0])[0]:  # every rank rolls back, or none
            where = f"first at step {first}" if count else "on another rank"
            self.machine.rollback(f"nonfinite_loss: {count} non-finite loss(es) in steps {since}-{step - 1}, {where}")

    def save_checkpoint(self, optimizers: list[Any], checkpoint: dict[str, Any]) -> None:
        """Save optimizers as the user built them (float learning rates, their own flags)."""
        for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", []), strict=False):
            prepared = self.optimizers.get(id(optimizer))
            if prepared is not None:
                prepared.plain_state_dict(state)

    def release(self) -> None:
        """Reset every step graph and give the optimizers and compiled modules back (even when a reset fails)."""
        self._plan = self._capturing = self._first = None
        steps = self.steps.clear()
        try:
            for whole in steps:
                whole.reset()
        finally:
            self.report.graphs = 0
            if self.compiled is not None:
                self.compiled.restore()
            optimizers, self.optimizers = list(self.optimizers.values()), {}
            for optimizer in optimizers:
                optimizer.restore()


def _metric_in_graph(updated: list[str], failure: str = "") -> str:
    return (
        f"metric_in_graph: torchmetrics metric(s) {updated} are updated inside the captured training_step{failure};"
        " a replay would not count their updates. Fix: update them in on_train_batch_end from the step's outputs,"
        " or use a scoped capture (scope=['layer'])"
    )


def _eager(run_step: Callable[[], Any]) -> Any:
    """Run an optimizer step eagerly; the optimizer is capturable, which PyTorch would warn about on every fit."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*")
        return run_step()
