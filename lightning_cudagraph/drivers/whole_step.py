"""The whole-step driver: ``training_step``, backward, clipping and the optimizer step as one graph.

The strategy hands it the batch (``batch_to_device``: :meth:`WholeStepDriver.plan` makes a
:data:`~lightning_cudagraph.drivers.step_pieces.StepPlan`), the output of ``training_step`` (captured output and
in-graph non-finite check), and the step itself (``optimizer_step``: :meth:`WholeStepDriver.run` carries the plan
out). A replayed step rebuilds Lightning's closure result and re-issues the captured ``self.log`` calls, so the loop,
loggers, checkpointing and early stopping behave as in eager training.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph.batches import batch_key, describe_batch_key, opaque_reason, own_copy
from lightning_cudagraph.compiling import CompiledModules, called_modules
from lightning_cudagraph.config import CUDAGraphConfig
from lightning_cudagraph.drivers.base import Driver, LevelSettings
from lightning_cudagraph.drivers.evidence import StateWatch
from lightning_cudagraph.drivers.shadow import precision_state
from lightning_cudagraph.drivers.shape_cache import ShapeCache
from lightning_cudagraph.drivers.shape_change import ShapeAction, ShapeDecision
from lightning_cudagraph.drivers.step_capture import StepCapture, metric_in_graph
from lightning_cudagraph.drivers.step_optimizers import StepOptimizers
from lightning_cudagraph.drivers.step_pieces import (
    CaptureStep,
    EagerStep,
    NonFiniteFlags,
    ReplayStep,
    StepPlan,
    WholeStep,
)
from lightning_cudagraph.drivers.step_replay import StepReplays, run_eagerly
from lightning_cudagraph.graphs.backend import CaptureBackend
from lightning_cudagraph.health import Stage
from lightning_cudagraph.snapshot import TrainingState
from lightning_cudagraph.stages import StageMachine


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
        settings: LevelSettings,
        compiled: CompiledModules | None = None,
    ) -> None:
        super().__init__(config, component, backend, machine, settings)
        self.compiled = compiled
        self.steps: ShapeCache[WholeStep] = self._shape_cache(WholeStep.reset)
        self.shapes = ShapeDecision(config.on_shape_change, self.steps, machine, component)
        self.optimizers = StepOptimizers(backend)
        self.flags = NonFiniteFlags(self.backend.device)
        self.capture = StepCapture(backend, machine, self.flags)
        self.replays = StepReplays(machine, self.optimizers, self.flags, config.audit_every_n_steps)
        self.state = StateWatch()
        self._plan: StepPlan | None = None
        self._first: WholeStep | None = None
        self._sightings: dict[tuple[Any, ...], int] = {}

    def start(self, trainer: pl.Trainer) -> None:
        """Switch optimizers to their capturable form for the whole fit, so their arithmetic never changes mid-run."""
        self.replays.checked_until = trainer.global_step
        for optimizer in trainer.optimizers:
            self.optimizers.prepare(optimizer)
        if self.compiled is not None:
            self.compiled.compile(called_modules(trainer.lightning_module))

    def begin_batch(self, trainer: pl.Trainer, batch: Any) -> None:
        """Turn the compiled modules on for this training step (evaluation runs them as built)."""
        if self.compiled is not None:
            self.compiled.active = self.machine.graphs_allowed

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
        seen = self._sightings.get(key, 0)
        outcome = self.shapes.decide(key, seen, self.eager_steps_needed())
        if outcome.action is ShapeAction.REPLAY:
            self._plan = ReplayStep(key, outcome.held)
            return outcome.held.stage(batch)
        if outcome.action is ShapeAction.FALLBACK:
            self._plan = EagerStep(fallback=outcome.reason)
            return batch
        self._sightings[key] = seen + 1
        if outcome.action is ShapeAction.EAGER:  # this shape's own eager steps
            self._plan = EagerStep(fallback=outcome.reason)
            return batch
        if outcome.action is ShapeAction.WAIT:
            return batch
        # A copy of this batch becomes the static buffers of the step about to be captured: later batches are copied
        # into it, so it must never be the user's own tensors (a dataset on the device would be overwritten).
        whole = WholeStep(static_batch=own_copy(batch), confirm_left=self.config.confirm_steps)
        self._plan = CaptureStep(key, whole, outcome.evicts)
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
            return run_eagerly(run_step)
        module = trainer.lightning_module
        problem = self.optimizers.settings_problem()
        if problem is not None:  # a setting moved during the warmup steps (it moves every step) or since capture
            self.machine.rollback(problem)
            return run_eagerly(run_step)
        if isinstance(plan, CaptureStep):
            # Everything the step changes, copied before the capture: a capture that is not kept puts it back, and
            # the graph's first run is a shadow step from it, so no unchecked replay ever trains.
            state = self._state_before_step(trainer, module)
            first = self.machine.stage == Stage.WARMUP
            if not self._capture(plan, optimizer, run_step, module, state):
                return run_eagerly(run_step)
            if first:
                self._first = plan.whole
                self.machine.begin_confirmation()
            return self.replays.shadow(plan.whole, trainer, closure, run_step, module, state)
        problem = self.state.problem()
        if problem is not None:
            self.machine.rollback(problem)
            return run_eagerly(run_step)
        if self.replays.audit_due():
            state = self._state_before_step(trainer, module)
            return self.replays.shadow(plan.whole, trainer, closure, run_step, module, state)
        return self.replays.replay(plan.whole, trainer, closure, module)

    def _state_before_step(self, trainer: pl.Trainer, module: Any) -> TrainingState:
        return TrainingState.take(module, self.optimizers.user, self.backend.device, precision_state(trainer))

    def _capture(
        self,
        plan: CaptureStep,
        optimizer: torch.optim.Optimizer,
        run_step: Callable[[], Any],
        module: Any,
        before: TrainingState,
    ) -> bool:
        whole, first = plan.whole, not self.captured_any
        self.optimizers.prepare(optimizer)
        self.before_capture()
        started = time.perf_counter()
        metrics = self.capture.capture(whole, run_step, module, before)
        if metrics is None:
            return False
        self.steps.add(plan.key, whole)
        self._sightings.pop(plan.key, None)
        if not self.count_capture(started, len(self.steps), undo=before.restore):
            return False
        updated = metrics.changed()
        if updated:
            before.restore()
            self.machine.rollback(metric_in_graph(updated))
            return False
        self.optimizers.captured()  # what this graph bakes in
        if first:  # later shapes must read the same tensors: a rebind in between is caught, not re-watched
            self.state.watch((*module.named_parameters(), *module.named_buffers()))
        evicted = f"; evicted batch {describe_batch_key(plan.evicts)}" if plan.evicts is not None else ""
        rank_zero_info(f"{self.component}: captured the whole step for batch {describe_batch_key(plan.key)}{evicted}")
        return True

    @property
    def shape_cache(self) -> ShapeCache[WholeStep]:
        """The captured steps by batch shape."""
        return self.steps

    @property
    def capturing(self) -> bool:
        """Whether the strategy's hooks are running inside a whole-step capture."""
        return self.capture.capturing

    def on_training_step_output(self, output: Any) -> None:
        """While capturing: keep ``training_step`` 's output (static tensors) and add the non-finite check."""
        self.capture.on_training_step_output(output)

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
        if len(self.steps) and self.machine.graphs_allowed:
            self.replays.check_finite(step)

    def save_checkpoint(self, optimizers: list[Any], checkpoint: dict[str, Any]) -> None:
        """Save optimizers as the user built them (float learning rates, their own flags)."""
        self.optimizers.save_checkpoint(optimizers, checkpoint)

    def release(self) -> None:
        """Reset every step graph and give the optimizers and compiled modules back (even when a reset fails)."""
        self._plan = self._first = None
        self.capture.release()
        steps = self.steps.clear()
        try:
            for whole in steps:
                whole.reset()
        finally:
            self.report.graphs = 0
            if self.compiled is not None:
                self.compiled.restore()
            self.optimizers.restore()
